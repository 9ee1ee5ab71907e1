"""The automatic judges checked against people, on the served pairs people decided. Pure.

A task pushed from what was served (kubealign.feedback.served) carries each judge's probability that answer1 is
the better answer (meta.kubealign.judges: {"reward" | "heldout" | "llm_judge": p}). On a pull, each judge's
**agreement** is the share of the decided tasks it leaned on (p != 0.5) where it leaned the way people's majority
chose, with its Wilson 95 % interval; a task where it did not lean (a tie, equal scores) is counted apart. Tasks
are read as annotations.pulled reads them: the same votes, a repeated task once. The people's **weighted
win-rate** of the challenger weighs each decided task by meta.kubealign.weight (feedback.choice: the pairs chosen
for disagreement 1, the random ones the pairs they stand for); it is unbiased over the served pairs only as far as
the skipped and tied tasks are like the decided ones.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kubealign.feedback.annotations import identity, votes, wilson
from kubealign.feedback.choice import weighted_rate
from kubealign.feedback.export import checked

JUDGES = ("reward", "heldout", "llm_judge")  # the order the figures and lines follow


class Agreement(NamedTuple):
    agreed: int
    leaned: int  # decided tasks the judge leaned on
    level: int  # decided tasks it did not lean on (p = 0.5)
    low: float
    high: float

    @property
    def rate(self) -> float:
        return self.agreed / self.leaned if self.leaned else math.nan


def decisions(tasks: Any) -> list[tuple[dict[str, Any], str]]:
    """(meta.kubealign, "answer1" | "answer2": the people's majority) of each decided task, a repeated one once."""
    out = []
    seen: set[tuple[Any, ...]] = set()
    for task in checked(tasks):
        if identity(task) in seen:
            continue
        seen.add(identity(task))
        cast = votes(task)
        first = sum(v == "answer1" for _, v in cast)
        if cast and 2 * first != len(cast):
            out.append((task["meta"]["kubealign"], "answer1" if 2 * first > len(cast) else "answer2"))
    return out


def agreements(decided: list[tuple[dict[str, Any], str]]) -> dict[str, Agreement]:
    """{judge: its Agreement with people} for each judge some decided task carries a probability of."""
    counts: dict[str, list[int]] = {}
    for meta, chose in decided:
        judges = meta.get("judges") if isinstance(meta.get("judges"), dict) else {}
        for name, p in judges.items():
            if not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
                continue
            count = counts.setdefault(name, [0, 0, 0])  # agreed, leaned, level
            if p == 0.5:
                count[2] += 1
                continue
            count[1] += 1
            count[0] += (p > 0.5) == (chose == "answer1")
    ordered = sorted(counts, key=lambda n: (JUDGES.index(n) if n in JUDGES else len(JUDGES), n))
    return {name: Agreement(a, n, t, *wilson(a, n)) for name in ordered for a, n, t in [counts[name]]}


def weighted_win_rate(decided: list[tuple[dict[str, Any], str]], challenger: str) -> float | None:
    """The challenger's win-rate over the decided tasks, each weighted by meta.kubealign.weight; None when no
    decided task carries a weight (tasks not chosen by feedback.choice)."""
    outcomes = []
    for meta, chose in decided:
        weight = meta.get("weight")
        if isinstance(weight, int | float) and weight > 0:
            outcomes.append((meta[chose].split(":")[0] == challenger, float(weight)))
    return weighted_rate(outcomes) if outcomes else None


def by_version(decided: list[tuple[dict[str, Any], str]], challenger: str) -> dict[str, tuple[float, int]]:
    """{version: (people's win-rate of the challenger's version, decided tasks)} over the decided tasks whose
    `challenger` side is that version, each weighted by meta.kubealign.weight where it carries one (feedback.choice:
    unbiased over what was served), else 1: the figure a version's own verdict reads, when the project holds
    several rounds (several challenger versions)."""
    outcomes: dict[str, list[tuple[bool, float]]] = {}
    for meta, chose in decided:
        sides = [meta[s] for s in ("answer1", "answer2") if meta[s].split(":")[0] == challenger]
        if len(sides) != 1:
            continue
        weight = meta.get("weight")
        weight = float(weight) if isinstance(weight, int | float) and weight > 0 else 1.0
        outcomes.setdefault(sides[0].split(":")[1], []).append((meta[chose] == sides[0], weight))
    return {v: (weighted_rate(won), len(won)) for v, won in sorted(outcomes.items(), key=lambda kv: int(kv[0]))}


def figures(found: dict[str, Agreement]) -> dict[str, float]:
    """The MLflow metrics of the agreements: agreement_<judge> (NaN when it leaned on no task), _low, _high, _n."""
    out: dict[str, float] = {}
    for name, a in found.items():
        out.update({f"agreement_{name}": a.rate, f"agreement_{name}_low": a.low, f"agreement_{name}_high": a.high})
        out[f"agreement_{name}_n"] = float(a.leaned)
    return out


def lines(found: dict[str, Agreement]) -> list[str]:
    """One summary line per judge."""
    out = []
    for name, a in found.items():
        level = f", {a.level} level" if a.level else ""
        rate = f"{a.rate:.2f}" if a.leaned else "n/a"
        interval = f"95 % {a.low:.2f}-{a.high:.2f}"
        out.append(f"  {name} agrees with people: {rate} ({a.agreed} of {a.leaned}; {interval}{level})")
    return out
