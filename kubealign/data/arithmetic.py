"""Built-in synthetic arithmetic: the data of the verifiable-rewards demo, where the answer can be checked.

The task is single-digit addition with a single-digit sum: "What is 3 + 4?" -> " 7" (a + b <= 9: one answer
token, 55 sums a tiny model learns quickly). A reward function checks the answer exactly
(configs/rewards/arithmetic.py), so no reward model is needed, and the policy must learn what the
demonstrations only half teach:

* **Demonstrations** (SFT-only rows, ``{prompt, response}``) are right in exactly RIGHT_SHARE of them; the
  others give a plausible wrong digit, like a careless labeller: one of the operands copied instead of the
  sum. SFT imitates that mixture, so the SFT model is right only about as often as its data. The mistake is
  one habit shared by every question (not a different slip per sum), so GRPO can unlearn it in a few dozen
  iterations: a tiny model learns "add, do not copy" once, where scattered off-by-one slips would have to be
  corrected sum by sum (measured: 30 GRPO iterations did not move those).
* **Prompts** (prompt-only rows, ``{prompt, answer}``) carry the true sum as the `answer` column: they go to
  phase 3 only (GRPO's prompts and evaluate's), and the reward function reads `answer` there.

Every prompt text is drawn once, without replacement, from OPERANDS x QUESTIONS x OPENERS, so a phase-3
prompt never repeats a demonstration's text (data-split groups rows by prompt text: a shared text would pull
the prompt-only row into phase 1 and drop it). The same sums appear in both, in other wordings: GRPO
sharpens what SFT learned instead of teaching new facts. Prompts follow the HH dialogue format of
`synthetic`. Everything is a pure function of the arguments and the seed.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from kubealign.data.synthetic import format_prompt
from kubealign.errors import UserError

OPERANDS: tuple[tuple[int, int], ...] = tuple((a, b) for a in range(10) for b in range(10) if a + b <= 9)
QUESTIONS: tuple[str, ...] = (
    "What is {a} + {b}?",
    "What is {a} plus {b}?",
    "How much is {a} + {b}?",
    "Add {a} and {b}.",
    "What do you get when you add {a} and {b}?",
    "Compute {a} + {b}.",
    "{a} + {b} = ?",
    "What is the sum of {a} and {b}?",
)
# short openers only: every prompt token costs SFT time on 2 cores, and the sums need many passes to be learned
OPENERS: tuple[str, ...] = ("", "Hi! ", "Quick question. ", "Please help. ")
RIGHT_SHARE = 0.5  # share of the demonstrations whose answer is right
VERSION = 1  # bump when the generator's output changes; it is part of the data cache key
CAPACITY = len(OPERANDS) * len(QUESTIONS) * len(OPENERS)


def _prompt_space() -> list[tuple[int, int, str]]:
    """All (a, b, question) combinations, in a fixed order."""
    return [
        (a, b, opener + template.format(a=a, b=b))
        for (a, b), template, opener in itertools.product(OPERANDS, QUESTIONS, OPENERS)
    ]


def wrong_sum(rng: random.Random, a: int, b: int) -> int:
    """A plausible wrong answer: one of the operands copied (one that is not the sum: 0 + 4 copies the 0),
    or, for 0 + 0, 1."""
    return rng.choice([x for x in (a, b) if x != a + b] or [1])


def operands(prompt: str) -> tuple[int, int] | None:
    """(a, b) of an arithmetic prompt: the two single digits its question names, None if it names other than two."""
    digits = [int(c) for c in prompt.rsplit("Human:", 1)[-1] if c.isdigit()]
    return (digits[0], digits[1]) if len(digits) == 2 else None


def generate(prompts: int, sft_rows: int, seed: int) -> list[dict[str, Any]]:
    """`sft_rows` demonstrations {prompt, response}, exactly round(RIGHT_SHARE * sft_rows) of them right, then
    `prompts` prompt-only rows {prompt, answer} (answer: the true sum, an int). Each row has its own prompt text."""
    if prompts + sft_rows > CAPACITY:
        raise UserError(
            f"data.synthetic_prompts + data.synthetic_sft_rows = {prompts + sft_rows} exceeds the "
            f"{CAPACITY} distinct synthetic-arithmetic prompts"
        )
    rng = random.Random(f"kubealign-arithmetic-{seed}")
    drawn = rng.sample(_prompt_space(), prompts + sft_rows)
    # exactly the configured share is right (not a coin per row), so a small SFT set shows the share it says
    right = set(rng.sample(range(sft_rows), round(RIGHT_SHARE * sft_rows)))
    rows: list[dict[str, Any]] = []
    for i, (a, b, question) in enumerate(drawn[:sft_rows]):
        answer = a + b if i in right else wrong_sum(rng, a, b)
        rows.append({"prompt": format_prompt(question), "response": f" {answer}"})
    for a, b, question in drawn[sft_rows:]:
        rows.append({"prompt": format_prompt(question), "answer": a + b})
    return rows
