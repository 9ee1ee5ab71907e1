"""The reward-KL frontier of a run's candidates (the DPO paper judges methods by it: expected reward
against KL to the reference, not one point): pure functions of (KL, reward) points."""

from __future__ import annotations

import math
from collections.abc import Mapping


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a = (kl, reward) is at least as good as b on both (lower KL, higher reward) and better on one."""
    return a[0] <= b[0] and a[1] >= b[1] and a != b


def pareto_front(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The names whose point no other point dominates, by KL ascending (then reward descending). A point
    without a finite KL or reward is on no front: its distance from the SFT model is unknown."""
    finite = {name: p for name, p in points.items() if math.isfinite(p[0]) and math.isfinite(p[1])}
    front = [name for name, p in finite.items() if not any(dominates(q, p) for q in finite.values())]
    return sorted(front, key=lambda name: (finite[name][0], -finite[name][1]))
