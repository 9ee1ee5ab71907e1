"""People's choices -> preference rows, and what they say of the two models. Pure.

A task's annotations (Label Studio's JSON export: each task with its `data`, `meta` and `annotations`) are
read as votes for answer1 ("left": the Pairwise control's first object) or answer2 ("right"). A task is:

* **pending** when nobody has annotated it yet;
* **skipped** when it has annotations and none of them chose (every one cancelled, Label Studio's "skip");
* **tied** when its votes split evenly (two people, two answers);
* **decided** otherwise: the majority's answer is `chosen`, the other `rejected`.

Pending, skipped and tied tasks give no row and are counted. A task that repeats an earlier one (the same prompt,
registered model, answers and sides) is a duplicate: left out of the rows, the counts and the win-rate, and counted.
The human win-rate is the share of decided tasks won by the side named `challenger` (its Wilson 95 %
interval beside it); agreement is, over tasks with two or more votes, the share of pairs of votes that agree.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any, NamedTuple

from kubealign.feedback.export import checked

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
    duplicates: int = 0  # tasks left out: the same prompt, answers and sides as an earlier task
    claims: dict[tuple[str | None, str], str] = {}  # (registered model, version) -> where a task first names it


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


def identity(task: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two tasks one comparison: the prompt, the registered model, and the two answers with their sides
    (in either order)."""
    data, meta = task["data"], task["meta"]["kubealign"]
    sides = frozenset(((data["answer1"], meta["answer1"]), (data["answer2"], meta["answer2"])))
    return data["prompt"], meta.get("registered_model"), sides


def pulled(tasks: Any, challenger: str = "challenger") -> Pulled:
    """The export's tasks -> rows and counts (module docstring), after checking each task (feedback.export: one
    line naming the task otherwise). challenger: the alias whose win-rate is reported (meta.kubealign.answerN is
    'alias:version'). A task that repeats an earlier one (identity) is left out and counted, so that a comparison
    counts once in the win-rate as its row appears once in the file."""
    rows: list[dict[str, str]] = []
    seen: set[tuple[Any, ...]] = set()
    texts: set[tuple[str, ...]] = set()
    decided = pending = skipped = tied = wins = duplicates = 0
    agree = pairs = 0
    annotators: set[int] = set()
    claims: dict[tuple[str | None, str], str] = {}
    for task in checked(tasks):
        meta = task["meta"]["kubealign"]
        for side in ("answer1", "answer2"):
            where = f"task {task.get('id')}: meta.kubealign.{side} {meta[side]!r}"
            claims.setdefault((meta.get("registered_model"), meta[side].split(":")[1]), where)
        if identity(task) in seen:
            duplicates += 1
            continue
        seen.add(identity(task))
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
        wins += meta[win].split(":")[0] == challenger
        data = task["data"]
        row = {"prompt": data["prompt"], "chosen": data[win], "rejected": data[lose]}
        if tuple(row.values()) not in texts:  # two comparisons with the same texts: one row (data-split's pairs)
            texts.add(tuple(row.values()))
            rows.append({**row, "chosen_by": meta[win], "rejected_by": meta[lose]})
    agreement = agree / pairs if pairs else None
    return Pulled(rows, decided, pending, skipped, tied, wins, agreement, sorted(annotators), duplicates, claims)


def wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
