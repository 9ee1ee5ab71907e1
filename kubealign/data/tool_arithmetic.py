"""Built-in data of the tools demo: three-digit sums a tiny model cannot do alone, and a tool that can.

"What is 347 + 589?" -> ' <tool_call>{"name": "add", "arguments": {"a": 347, "b": 589}}</tool_call>'
'<tool_response>936</tool_response> 936'. A 2-layer model does not learn three-digit addition from a
thousand examples, but it can learn to copy: the operands into the call, the tool's answer into its own.

* **Demonstrations** (SFT-only rows, ``{prompt, response}``) mix three habits, in fixed shares: CALL_SHARE
  call the tool and copy its answer; MISCOPY_SHARE call it and then answer with the first operand instead
  (one careless habit shared by every question, so that GRPO can unlearn it, as the arithmetic demo's);
  the rest answer at once with the right sum, which the model cannot learn to compute. The tool's answers
  inside the demonstrations are not SFT targets (data.tokenize: the model never writes them).
* **Prompts** (prompt-only rows, ``{prompt, answer}``) carry the true sum: phase 3 only, read by the reward
  function (configs/rewards/tool_arithmetic.py).

Every prompt text is drawn once, without replacement, from OPERANDS x QUESTIONS x OPENERS; a pure function
of the arguments and the seed.
"""

from __future__ import annotations

import json
import random
from typing import Any

from kubealign.data.synthetic import format_prompt
from kubealign.data.tokenize import RESULT_CLOSE, RESULT_OPEN
from kubealign.errors import UserError

LOW, HIGH = 100, 999  # operands: three digits
QUESTIONS: tuple[str, ...] = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "{a} + {b} = ?")
OPENERS: tuple[str, ...] = ("", "Hi! ", "Please help. ")
CALL_SHARE, MISCOPY_SHARE = 0.5, 0.25  # the rest answer without the tool
VERSION = 1  # bump when the generator's output changes; it is part of the data cache key
SPAN = HIGH - LOW + 1
CAPACITY = SPAN * SPAN * len(QUESTIONS) * len(OPENERS)


def call(a: int, b: int) -> str:
    """The demonstrations' call of the `add` tool (rl.tool_calls.call_text's format)."""
    return "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</tool_call>"


def _question(index: int) -> tuple[int, int, str]:
    """The index-th (a, b, question) of the prompt space, in a fixed order."""
    index, opener = divmod(index, len(OPENERS))
    index, template = divmod(index, len(QUESTIONS))
    a, b = LOW + index // SPAN, LOW + index % SPAN
    return a, b, OPENERS[opener] + QUESTIONS[template].format(a=a, b=b)


def generate(prompts: int, sft_rows: int, seed: int) -> list[dict[str, Any]]:
    """`sft_rows` demonstrations {prompt, response} in the shares of the module docstring, then `prompts`
    prompt-only rows {prompt, answer} (the true sum, an int), each with its own prompt text."""
    if prompts + sft_rows > CAPACITY:
        raise UserError(
            f"data.synthetic_prompts + data.synthetic_sft_rows = {prompts + sft_rows} exceeds the "
            f"{CAPACITY} distinct synthetic-tool-arithmetic prompts"
        )
    rng = random.Random(f"kubealign-tool-arithmetic-{seed}")
    drawn = [_question(i) for i in rng.sample(range(CAPACITY), prompts + sft_rows)]
    order = list(range(sft_rows))
    rng.shuffle(order)
    calls, miscopies = round(CALL_SHARE * sft_rows), round(MISCOPY_SHARE * sft_rows)
    habit = {i: "call" for i in order[:calls]} | {i: "miscopy" for i in order[calls : calls + miscopies]}
    rows: list[dict[str, Any]] = []
    for i, (a, b, question) in enumerate(drawn[:sft_rows]):
        kind = habit.get(i, "direct")
        if kind == "direct":
            response = f" {a + b}"
        else:
            told = f"{RESULT_OPEN}{a + b}{RESULT_CLOSE}"
            response = f" {call(a, b)}{told} {a + b if kind == 'call' else a}"
        rows.append({"prompt": format_prompt(question), "response": response})
    for a, b, question in drawn[sft_rows:]:
        rows.append({"prompt": format_prompt(question), "answer": a + b})
    return rows
