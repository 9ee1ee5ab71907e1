"""People's choices -> preference rows (issue 59): sides shuffled per task and mapped back, skipped and tied
tasks counted and left out, the challenger's win-rate with its Wilson interval, agreement between people."""

from __future__ import annotations

import pytest

from kubealign.feedback import annotations as an
from kubealign.feedback import pairs

pytestmark = pytest.mark.unit
CHAMPION, CHALLENGER = pairs.Side("champion", "3"), pairs.Side("challenger", "4")


def vote(who: int, selected: str | None, cancelled: bool = False) -> dict:
    result = (
        [] if selected is None else [{"from_name": "comparison", "type": "pairwise", "value": {"selected": selected}}]
    )
    return {"completed_by": who, "was_cancelled": cancelled, "result": result}


def exported(pushed: list[dict], ballots: list[list[dict]]) -> list[dict]:
    return [{"id": i + 1, **task, "annotations": b} for i, (task, b) in enumerate(zip(pushed, ballots, strict=True))]


def test_sides_are_shuffled_per_task_and_kept_in_meta():
    prompts = [f"q{i}" for i in range(40)]
    pushed = pairs.pairwise_tasks(
        prompts,
        [f"champ{i}" for i in range(40)],
        [f"chal{i}" for i in range(40)],
        (CHAMPION, CHALLENGER),
        7,
        "kubealign-actor",
    )
    left = [t["meta"]["kubealign"]["answer1"] for t in pushed]
    assert 10 < left.count("champion:3") < 30  # both sides on the left, about half of the time
    for i, t in enumerate(pushed):
        sides = {
            t["meta"]["kubealign"]["answer1"]: t["data"]["answer1"],
            t["meta"]["kubealign"]["answer2"]: t["data"]["answer2"],
        }
        assert sides == {"champion:3": f"champ{i}", "challenger:4": f"chal{i}"}
        assert set(t["data"]) == {"prompt", "answer1", "answer2"}  # no identity where the annotator looks
        assert t["meta"]["kubealign"]["registered_model"] == "kubealign-actor"  # what the pull checks
    assert pushed == pairs.pairwise_tasks(
        prompts,
        [f"champ{i}" for i in range(40)],
        [f"chal{i}" for i in range(40)],
        (CHAMPION, CHALLENGER),
        7,
        "kubealign-actor",
    )
    present = {pairs.prompt_key("q0"), pairs.prompt_key("q5")}
    assert [t["data"]["prompt"] for t in pairs.new_tasks(pushed, present)] == [
        p for p in prompts if p not in ("q0", "q5")
    ]


def test_choices_map_back_to_the_models_and_odd_tasks_are_counted():
    pushed = pairs.pairwise_tasks(
        ["a", "b", "c", "d", "e"],
        ["A0", "B0", "C0", "D0", "E0"],
        ["A1", "B1", "C1", "D1", "E1"],
        (CHAMPION, CHALLENGER),
        1,
        "kubealign-actor",
    )
    challenger_left = [t["meta"]["kubealign"]["answer1"] == "challenger:4" for t in pushed]

    def pick(i: int, side: str) -> str:
        """The Pairwise value that chooses `side`'s answer in task i."""
        return "left" if challenger_left[i] == (side == "challenger") else "right"

    ballots = [
        [vote(1, pick(0, "challenger")), vote(2, pick(0, "challenger"))],  # both for the challenger
        [vote(1, pick(1, "champion"))],  # one person, for the champion
        [vote(1, None, cancelled=True)],  # skipped
        [vote(1, pick(3, "challenger")), vote(2, pick(3, "champion"))],  # conflicting: tied
        [vote(2, pick(4, "challenger")), vote(1, pick(4, "challenger")), vote(3, pick(4, "champion"))],  # 2 to 1
    ]
    out = an.pulled(exported(pushed, ballots))
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in out.rows] == [
        ("a", "A1", "A0"),
        ("b", "B0", "B1"),
        ("e", "E1", "E0"),
    ]
    assert [r["chosen_by"] for r in out.rows] == ["challenger:4", "champion:3", "challenger:4"]
    assert (out.decided, out.pending, out.skipped, out.tied, out.challenger_wins) == (3, 0, 1, 1, 2)
    assert an.pulled([{**pushed[0], "annotations": []}]).pending == 1  # nobody has looked at it yet
    # agreeing pairs: task a 1 of 1, task d 0 of 1, task e 1 of 3
    assert out.agreement == pytest.approx(2 / 5)
    assert out.annotators == [1, 2, 3]


def test_the_same_pair_twice_is_one_row_and_one_decided_task():
    task = {
        "data": {"prompt": "p", "answer1": "x", "answer2": "y"},
        "meta": {"kubealign": {"answer1": "challenger:4", "answer2": "champion:3"}},
    }
    out = an.pulled([{**task, "annotations": [vote(1, "left")]}, {**task, "annotations": [vote(2, "left")]}])
    assert len(out.rows) == 1 and out.decided == 1 and out.challenger_wins == 1 and out.duplicates == 1
    swapped = {  # the same comparison with the sides the other way round: a duplicate too
        "data": {"prompt": "p", "answer1": "y", "answer2": "x"},
        "meta": {"kubealign": {"answer1": "champion:3", "answer2": "challenger:4"}},
    }
    out = an.pulled([{**task, "annotations": [vote(1, "left")]}, {**swapped, "annotations": [vote(2, "left")]}])
    assert (len(out.rows), out.decided, out.duplicates) == (1, 1, 1)


def test_wilson_interval():
    low, high = an.wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert an.wilson(0, 0) == (0.0, 1.0)
    assert an.wilson(5, 5)[1] == 1.0
