"""The ranking rule of several routes' evaluations (the compare stage's; see its docstring for the rule and
why): pure functions of metric dicts."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kubealign.errors import UserError

REWARD, KL = "candidate_reward_mean", "kl_to_baseline"


class Standing(NamedTuple):
    """One finished route's place: rank 1 is the leader; `why` says what put it behind the leader."""

    route: str
    rank: int
    measure: float
    reward: float
    kl: float
    why: str


def measure_of(metric: str) -> str:
    """The evaluation metric ranked first: the win-rate's lower bound, or promote.metric itself."""
    return "win_rate_lower_bound" if metric == "win_rate" else metric


def rank(evaluations: Mapping[str, Mapping[str, float]], metric: str, order: Sequence[str]) -> list[Standing]:
    """The finished routes (route -> evaluate metrics) ranked by the rule above; `order` is
    pipeline.algorithms, the last tie-break. A missing KL counts as the largest."""
    measure = measure_of(metric)
    for route, metrics in evaluations.items():
        for name in (measure, REWARD):
            if name not in metrics:
                raise UserError(f"compare: the {route} evaluation has no {name} (promote.metric {metric})")

    def key(route: str) -> tuple[float, float, float, int]:
        m = evaluations[route]
        return (-m[measure], -m[REWARD], m.get(KL, math.inf), order.index(route))

    ranked = sorted(evaluations, key=key)
    leader = ranked[0] if ranked else ""
    return [
        Standing(
            route,
            place + 1,
            evaluations[route][measure],
            evaluations[route][REWARD],
            evaluations[route].get(KL, math.inf),
            "" if route == leader else behind(evaluations[route], evaluations[leader], leader, measure),
        )
        for place, route in enumerate(ranked)
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
    return f"tied with {leader} on {', '.join(tied)}; {leader} comes first in pipeline.algorithms"
