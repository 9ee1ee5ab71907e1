"""Reward function of the tiny-cpu-verifiable preset: is the answer to the arithmetic question exactly right?

Referenced as `rewards/arithmetic.py:exact_answer` (relative to the preset). It gets the phase-3 rows'
`answer` column, which the built-in `synthetic-arithmetic` source writes on its prompt-only rows. It runs
in kubealign's reward-function worker, from the source text embedded in the pipeline: it imports nothing
but the standard library, so it runs in any image.
"""


def exact_answer(prompts, completions, answer, **columns):
    """1.0 when the completion, stripped of surrounding whitespace, is the answer's digits; else 0.0.
    None (the function does not apply) for a row without an answer: it is left out of the metric's mean."""
    return [None if a is None else float(c.strip() == str(a)) for c, a in zip(completions, answer, strict=True)]
