"""Reward function of the tiny-cpu-tools preset: is the final answer right?

Referenced as `rewards/tool_arithmetic.py:final_answer`. A completion here is the whole trajectory: the
model's turns and the tools' answers (<tool_response>...</tool_response>). The final answer is what the model
wrote after the last tool answer (all of it when it called no tool); it must be the sum's digits. Standard
library only: it runs in any image.
"""


def final_answer(prompts, completions, answer, **columns):
    """1.0 when the text after the last tool answer, stripped, is the answer's digits; else 0.0; None for a row
    without an answer (left out of the metric's mean)."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            out.append(None)
            continue
        final = completion.rpartition("</tool_response>")[2]
        out.append(float(final.strip() == str(expected)))
    return out
