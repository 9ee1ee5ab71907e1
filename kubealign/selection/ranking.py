"""The ranking rule of several candidates' evaluations (the compare stage's; see its docstring for the rule and
why): pure functions of metric dicts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kubealign.errors import UserError

REWARD, KL = "candidate_reward_mean", "kl_to_baseline"


def standing_name(standing: Mapping[str, object]) -> str:
    """The candidate a standing of the compare stage's result.json is about; one written before the field had
    its name calls it "route" (an earlier run that `kubealign rerun promote` reads again)."""
    return str(standing["candidate"] if "candidate" in standing else standing["route"])


class Standing(NamedTuple):
    """One finished candidate's place (`candidate`: its name): rank 1 is the leader unless over the KL budget;
    `why` says what put it behind the leader, or that it is over the budget."""

    candidate: str
    rank: int
    measure: float
    reward: float
    kl: float
    why: str


def measure_of(metric: str) -> str:
    """The evaluation metric ranked first: the win-rate's lower bound, or promote.metric itself."""
    return "win_rate_lower_bound" if metric == "win_rate" else metric


def within(kl: float, max_kl: float | None) -> bool:
    """Whether a candidate's KL to the SFT model keeps pipeline.max_kl (None: no budget; a missing KL,
    counted as infinite, keeps none)."""
    return max_kl is None or kl <= max_kl


def rank(
    evaluations: Mapping[str, Mapping[str, float]],
    metric: str,
    order: Sequence[str],
    max_kl: float | None = None,
    refused: Mapping[str, str] | None = None,
) -> list[Standing]:
    """The finished candidates (name -> evaluate metrics) ranked by the rule above; `order` is the order the
    candidates were listed in, the last tie-break. A missing KL counts as the largest. With a KL budget
    (pipeline.max_kl), the candidates over it come after every one within it, ranked among themselves by
    the same rule; so do the candidates a promotion guard refuses (`refused`: name -> the guard's failed
    check, kubealign.promotion.guards): the leader is standings[0] only when eligible(it)."""
    refused = refused or {}
    measure = measure_of(metric)
    for candidate, metrics in evaluations.items():
        for name in (measure, REWARD):
            if name not in metrics:
                raise UserError(f"compare: the {candidate} evaluation has no {name} (promote.metric {metric})")

    def kl(candidate: str) -> float:
        return evaluations[candidate].get(KL, math.inf)

    def key(candidate: str) -> tuple[bool, float, float, float, int]:
        m = evaluations[candidate]
        eligible = within(kl(candidate), max_kl) and candidate not in refused
        return (not eligible, -m[measure], -m[REWARD], kl(candidate), order.index(candidate))

    ranked = sorted(evaluations, key=key)
    leader = ranked[0] if ranked else ""

    def why(candidate: str) -> str:
        if candidate in refused:
            return f"refused by a guard: {refused[candidate]}"
        if not within(kl(candidate), max_kl):
            return f"{KL} {kl(candidate):.4g} > pipeline.max_kl {max_kl:.4g}"
        return "" if candidate == leader else behind(evaluations[candidate], evaluations[leader], leader, measure)

    return [
        Standing(c, place + 1, evaluations[c][measure], evaluations[c][REWARD], kl(c), why(c))
        for place, c in enumerate(ranked)
    ]


def behind(ours: Mapping[str, float], theirs: Mapping[str, float], leader: str, measure: str) -> str:
    """The first key of the rule on which `ours` loses to the leader's, in words."""
    tied = []
    for name, higher in ((measure, True), (REWARD, True), (KL, False)):
        a, b = ours.get(name, math.inf), theirs.get(name, math.inf)
        if a != b:
            relation = "<" if higher else ">"
            said = f"{name} {a:.4g} {relation} {leader}'s {b:.4g}"
            return f"tied on {', '.join(tied)}; {said}" if tied else said
        tied.append(name)
    return f"tied with {leader} on {', '.join(tied)}; {leader} is listed first"
