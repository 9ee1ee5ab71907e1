"""People's choices -> preference rows, and what they say of the two models. Pure.

A task's annotations (Label Studio's JSON export: each task with its `data`, `meta` and `annotations`) are
read as votes for answer1 ("left": the Pairwise control's first object) or answer2 ("right"). A task is:

* **pending** when nobody has annotated it yet;
* **skipped** when it has annotations and none of them chose (every one cancelled, Label Studio's "skip");
* **tied** when its votes split evenly (two people, two answers);
* **decided** otherwise: the majority's answer is `chosen`, the other `rejected`.

Pending, skipped and tied tasks give no row and are counted. Rows are deduplicated on (prompt, chosen, rejected).
The human win-rate is the share of decided tasks won by the side named `challenger` (its Wilson 95 %
interval beside it); agreement is, over tasks with two or more votes, the share of pairs of votes that agree.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any, NamedTuple

ANSWER = {"left": "answer1", "right": "answer2"}


class Pulled(NamedTuple):
    rows: list[dict[str, str]]  # {prompt, chosen, rejected, chosen_by, rejected_by}: data-split's pair layout
    decided: int
    pending: int
    skipped: int
    tied: int
    challenger_wins: int  # decided tasks the challenger side won
    agreement: float | None  # share of agreeing vote pairs over tasks with >= 2 votes; None: no such task
    annotators: list[int]  # who voted (Label Studio user ids)


def votes(task: dict[str, Any], control: str = "comparison") -> list[tuple[int, str]]:
    """(annotator, "answer1" | "answer2") of each annotation that chose; cancelled ones and others give none."""
    out = []
    for annotation in task.get("annotations", []):
        if annotation.get("was_cancelled"):
            continue
        for result in annotation.get("result", []):
            selected = result.get("value", {}).get("selected")
            if result.get("from_name") == control and selected in ANSWER:
                out.append((annotation.get("completed_by"), ANSWER[selected]))
                break
    return out


def pulled(tasks: list[dict[str, Any]], challenger: str = "challenger") -> Pulled:
    """The export's tasks -> rows and counts (module docstring). challenger: the alias whose win-rate is
    reported (meta.kubealign.answerN is 'alias:version')."""
    rows: list[dict[str, str]] = []
    seen: set[tuple[str, str, str]] = set()
    decided = pending = skipped = tied = wins = 0
    agree = pairs = 0
    annotators: set[int] = set()
    for task in tasks:
        cast = votes(task)
        annotators.update(who for who, _ in cast if who is not None)
        for (_, a), (_, b) in combinations(cast, 2):
            pairs += 1
            agree += a == b
        if not cast:
            if task.get("annotations"):
                skipped += 1
            else:
                pending += 1
            continue
        first = sum(v == "answer1" for _, v in cast)
        if 2 * first == len(cast):
            tied += 1
            continue
        decided += 1
        win, lose = ("answer1", "answer2") if 2 * first > len(cast) else ("answer2", "answer1")
        meta = task.get("meta", {}).get("kubealign", {})
        wins += meta.get(win, "").split(":")[0] == challenger
        data = task["data"]
        key = (data["prompt"], data[win], data[lose])
        if key not in seen:
            seen.add(key)
            rows.append(
                {
                    "prompt": key[0],
                    "chosen": key[1],
                    "rejected": key[2],
                    "chosen_by": meta.get(win, ""),
                    "rejected_by": meta.get(lose, ""),
                }
            )
    agreement = agree / pairs if pairs else None
    return Pulled(rows, decided, pending, skipped, tied, wins, agreement, sorted(annotators))


def wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
