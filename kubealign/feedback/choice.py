"""Which served pairs people are asked about, and how their choices are weighted back. Pure.

Every automatic judge of a served pair (the training reward model, the held-out one, the LLM judge) says how likely
the canary's answer is the better one: a reward model by the Bradley-Terry probability of its two scores,
sigmoid(canary - champion) (the loss it was trained with, InstructGPT eq. 1); the LLM judge by its verdict in both
orders (canary 1, champion 0, tie 0.5; no verdict: no vote). A pair's **priority** is, with two judges or more, how
far apart they are (the highest probability less the lowest: 1 when one is sure of the canary and another of the
champion, 0 when they say the same); with one judge, how unsure it is, 4 p (1 - p) (1 at p = 0.5, 0 when sure).

A round's **budget** of tasks is spent in two strata: the `budget - round(budget * random_share)` pairs of highest
priority (ties: the earlier prompt) are taken for certain, the rest of the budget is a simple random sample of the
pairs left. A certain pair stands for itself (weight 1); a random one for the pairs left that were not drawn
(weight left / drawn, the inverse of its chance of being drawn). The weighted share of wins (Horvitz-Thompson over
the two strata) then estimates the win-rate over every served pair without the bias of asking where judges disagree.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

CERTAIN, RANDOM = "disagreement", "random"  # the two strata, as tasks' meta.kubealign.stratum names them
LLM_VOTES = {"canary": 1.0, "champion": 0.0, "tie": 0.5}


class Chosen(NamedTuple):
    index: int  # the pair's position among the served pairs
    stratum: str  # CERTAIN or RANDOM
    weight: float  # how many served pairs it stands for


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def canary_probabilities(scores: dict[str, tuple[float, float]], llm_verdict: str | None) -> dict[str, float]:
    """{judge: P(the canary's answer is better)} of one pair. scores: {judge: (champion's score, canary's score)}
    of each reward model that scored it; llm_verdict: "canary" | "champion" | "tie" | None (not asked, no verdict)."""
    out = {name: sigmoid(canary - champion) for name, (champion, canary) in scores.items()}
    if llm_verdict in LLM_VOTES:
        out["llm_judge"] = LLM_VOTES[llm_verdict]
    return out


def priority(probabilities: dict[str, float]) -> float:
    """The spread of the judges' probabilities (max - min) with two judges or more; 4 p (1 - p) of one judge's p;
    1.0 (ask) for a pair no judge voted on."""
    if not probabilities:
        return 1.0
    if len(probabilities) == 1:
        (p,) = probabilities.values()
        return 4.0 * p * (1.0 - p)
    # Where the judges disagree, people's choice says which of them to trust (the gate's min_judge_agreement); where
    # they agree, however unsure (the mean probability near 0.5, the first rule), it tells the judges apart no more
    # than a random pair. Replayed on 15 of the rehearsal's served pools (benchmarks/feedback_choice.py), the spread
    # made the online gate right as often as random pairs did, the mean near 0.5 less often (docs/feedback.md).
    return max(probabilities.values()) - min(probabilities.values())


def choose(priorities: list[float], budget: int, random_share: float, seed: int) -> list[Chosen]:
    """The pairs to ask about (module docstring), certain ones first in priority order, then the random ones in
    index order. budget >= len(priorities): every pair, each weight 1."""
    if budget < 0 or not 0.0 <= random_share <= 1.0:
        raise ValueError(f"budget {budget} and random_share {random_share}: need budget >= 0 and 0 <= share <= 1")
    total = len(priorities)
    budget = min(budget, total)
    certain_count = budget - round(budget * random_share)
    order = sorted(range(total), key=lambda i: (-priorities[i], i))
    certain = order[:certain_count]
    left = sorted(order[certain_count:])
    drawn = sorted(random.Random(f"kubealign-choice-{seed}").sample(left, budget - certain_count))
    weight = len(left) / len(drawn) if drawn else 0.0
    return [Chosen(i, CERTAIN, 1.0) for i in certain] + [Chosen(i, RANDOM, weight) for i in drawn]


def weighted_rate(outcomes: list[tuple[bool, float]]) -> float:
    """The weighted share of wins, sum(w * won) / sum(w), over (won, weight) of the decided tasks; NaN for none."""
    total = sum(w for _, w in outcomes)
    return sum(w for won, w in outcomes if won) / total if total > 0 else math.nan
