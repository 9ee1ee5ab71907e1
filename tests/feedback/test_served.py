"""Pairs from what was served (issue 79): the judge's answers.json as tasks without regenerating, the versions,
prompt digest, judge run and round on each; the choice of pairs; the judges checked against people on pull, with
the weighted win-rate per round. The judge output is written here as stages/judge.py writes it; figures by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.feedback import agreement, pairs, served
from kubealign.feedback.annotations import wilson
from kubealign.feedback.pull import served_figures

pytestmark = pytest.mark.unit


def answer(text: str | None) -> dict:
    return {"text": text, "ok": text is not None, "finished": True, "latency_s": 0.1}


ROWS = [  # the champion's and canary's answers, and each reward model's [champion's, canary's] scores
    {"prompt": "p0", "champion": answer("c0"), "canary": answer("k0"), "scores": {"reward": [0.0, 4.0]}},
    {"prompt": "p1", "champion": answer("c1"), "canary": answer("k1"), "scores": {"reward": [1.0, 1.0]}},
    {"prompt": "p2", "champion": answer("c2"), "canary": answer(None)},  # the canary failed: no pair
    {"prompt": "p3", "champion": answer("c3"), "canary": answer("k3"), "scores": {"reward": [2.0, 0.0]}},
    {
        "prompt": "p4",
        "champion": answer("c4"),
        "canary": answer("k4"),
        "scores": {"reward": [0.0, 3.0], "heldout": [3.0, 0.0]},  # the two reward models split
    },
]


def judge_dir(root: Path, rows: list[dict] = ROWS, versions: dict | None = None) -> Path:
    out = root / "judge"
    out.mkdir(parents=True, exist_ok=True)
    (out / "answers.json").write_text(json.dumps(rows))
    result = {"stage": "judge", "metrics": {}, "versions": versions or {"champion": "3", "canary": "4"}}
    (out / "result.json").write_text(json.dumps({**result, "judge_run": "run-j1", "registered_model": "actor"}))
    return out


def test_served_pairs_become_tasks_without_regenerating(tmp_path):
    got = served.served_tasks(judge_dir(tmp_path), "actor", budget=3, random_share=1 / 3, seed=5, round_number=2)
    assert got.served == 4 and got.versions == ("3", "4") and got.judge_run == "run-j1"
    # priorities: p0 4p(1-p) of sigmoid(4) = 0.07, p1 1.0 (level), p3 sigmoid(-2) -> 0.42, p4 two judges apart:
    # sigmoid(3) - sigmoid(-3) = 0.905; 3 - round(1) = 2 certain: p1 then p4; 1 drawn from p0 and p3, standing for 2
    strata = [
        (t["data"]["prompt"], t["meta"]["kubealign"]["stratum"], t["meta"]["kubealign"]["weight"]) for t in got.tasks
    ]
    assert strata[:2] == [("p1", "disagreement", 1.0), ("p4", "disagreement", 1.0)]
    assert strata[2][0] in ("p0", "p3") and strata[2][1:] == ("random", 2.0)
    by_prompt = {r["prompt"]: r for r in ROWS}
    for task in got.tasks:
        meta, data = task["meta"]["kubealign"], task["data"]
        row = by_prompt[data["prompt"]]
        texts = {meta["answer1"]: data["answer1"], meta["answer2"]: data["answer2"]}
        assert texts == {"champion:3": row["champion"]["text"], "challenger:4": row["canary"]["text"]}  # as served
        assert meta["prompt_sha256"] == pairs.prompt_key(data["prompt"]) and meta["registered_model"] == "actor"
        assert (meta["judge_run"], meta["round"]) == ("run-j1", 2)
        assert meta["judge_output"] == str((tmp_path / "judge").resolve())
        champion, canary = row["scores"]["reward"]
        p_canary = 1 / (1 + math.exp(champion - canary))
        left_is_canary = meta["answer1"] == "challenger:4"
        assert meta["judges"]["reward"] == pytest.approx(p_canary if left_is_canary else 1 - p_canary)
    p4 = next(t["meta"]["kubealign"] for t in got.tasks if t["data"]["prompt"] == "p4")
    spread = 1 / (1 + math.exp(-3)) - 1 / (1 + math.exp(3))
    assert p4["priority"] == pytest.approx(spread, abs=1e-6) and set(p4["judges"]) == {"reward", "heldout"}


def test_identical_answers_are_never_pushed_though_every_judge_is_level_on_them(tmp_path):
    same = {"prompt": "p5", "champion": answer("s"), "canary": answer("s"), "scores": {"reward": [1.0, 1.0]}}
    rows = [same, *ROWS, {**same, "prompt": "p6"}]
    got = served.served_tasks(judge_dir(tmp_path, rows), "actor", budget=2, random_share=0.0, seed=5, round_number=0)
    # p5 and p6 would come first (priority 1, the earliest); the level pair with different answers, p1, does
    assert [t["data"]["prompt"] for t in got.tasks] == ["p1", "p4"]
    assert (got.served, got.identical) == (4, 2)


def test_the_next_rounds_versions_make_new_comparisons_of_the_same_prompts(tmp_path):
    first = served.served_tasks(judge_dir(tmp_path / "a"), "actor", 4, 0.0, 5, 0).tasks
    again = served.served_tasks(judge_dir(tmp_path / "b"), "actor", 4, 0.0, 5, 0).tasks
    later = served.served_tasks(
        judge_dir(tmp_path / "c", versions={"champion": "4", "canary": "6"}), "actor", 4, 0, 5, 1
    )
    present = {pairs.task_key(t["meta"]["kubealign"]) for t in first}
    assert pairs.new_tasks(again, present) == []  # the same served pairs: nothing new
    assert len(pairs.new_tasks(later.tasks, present)) == 4  # the same prompts, new versions: all new


@pytest.mark.parametrize(
    ("rows", "versions", "message"),
    [
        (ROWS, {"champion": "3"}, r"judge/result.json: versions.canary is None, not a registry version"),
        (ROWS, {"champion": "?", "canary": "4"}, r"versions.champion is '\?'"),
        ({"prompt": "x"}, None, r"judge/answers.json: not a list of prompts"),
        ([{"prompt": "x", "champion": answer("a")}], None, r"answers.json: \[0\]: canary is not an answer object"),
        (
            [{"prompt": "x", "champion": answer("a"), "canary": answer("b"), "scores": {"reward": [1]}}],
            None,
            r"answers.json: \[0\]: scores.reward is not \[champion's, canary's\] numbers",
        ),
    ],
)
def test_a_judge_output_that_is_not_one_is_one_line(tmp_path, rows, versions, message):
    where = judge_dir(tmp_path, rows, versions)
    with pytest.raises(UserError, match=message):
        served.served_tasks(where, "actor", 4, 0.25, 0, 0)
    (where / "result.json").unlink()
    with pytest.raises(UserError, match="no result.json; is this a judge output"):
        served.read_judged(where)


def vote(who: int, selected: str) -> dict:
    return {"completed_by": who, "result": [{"from_name": "comparison", "value": {"selected": selected}}]}


def task(number: int, judges: dict, ballots: list[str], rnd: int = 0, weight: float = 1.0, swap: bool = False):
    sides = ("challenger:4", "champion:3") if swap else ("champion:3", "challenger:4")
    meta = {"answer1": sides[0], "answer2": sides[1], "registered_model": "actor", "judges": judges}
    meta.update(round=rnd, weight=weight)
    data = {"prompt": f"q{number}", "answer1": f"a{number}", "answer2": f"b{number}"}
    votes = [vote(i + 1, side) for i, side in enumerate(ballots)]
    return {"id": number, "data": data, "meta": {"kubealign": meta}, "annotations": votes}


EXPORT = [  # judges' P(answer1 better); people's majority: left = answer1
    task(1, {"reward": 0.9, "llm_judge": 1.0}, ["left"]),  # reward agrees, llm agrees
    task(2, {"reward": 0.8, "llm_judge": 0.5}, ["right"]),  # reward disagrees, llm level
    task(3, {"reward": 0.3, "llm_judge": 0.0}, ["right", "right", "left"], swap=True),  # both agree
    task(4, {"reward": 0.1}, ["right"], rnd=1, weight=3.0),  # reward agrees
    task(5, {"reward": 0.7}, ["left", "right"]),  # tied: not decided, not counted
    task(6, {"reward": 0.9}, []),  # pending
    task(1, {"reward": 0.9, "llm_judge": 1.0}, ["left"]),  # the first task again: counted once
]


def test_each_judges_agreement_with_people_by_hand():
    found = agreement.agreements(agreement.decisions(EXPORT))
    assert list(found) == ["reward", "llm_judge"]
    # reward: tasks 1, 3, 4 agree, 2 does not (3 of 4); llm_judge: 1 and 3 agree, 2 level (2 of 2, 1 level)
    assert found["reward"] == (3, 4, 0, *wilson(3, 4))
    assert found["llm_judge"] == (2, 2, 1, *wilson(2, 2))
    assert found["reward"].low == pytest.approx(0.3006, abs=1e-4) and found["reward"].high == pytest.approx(
        0.9544, abs=1e-4
    )
    figures = agreement.figures(found)
    assert figures["agreement_reward"] == 0.75 and figures["agreement_reward_n"] == 4.0
    assert figures["agreement_llm_judge"] == 1.0
    assert agreement.lines(found)[1] == "  llm_judge agrees with people: 1.00 (2 of 2; 95 % 0.34-1.00, 1 level)"


def test_the_weighted_win_rate_per_round_by_hand():
    metrics: dict[str, float] = {}
    lines: list[str] = []
    served_figures(EXPORT, "challenger", metrics, lines)
    # decided: 1 left=champion (loss), 2 right=challenger (win), 3 right=champion (swap: loss), 4 right=challenger
    # (win, weight 3). Round 0: 1 win of 3; round 1: 1 of 1; all: (1 + 3) / (1 + 1 + 1 + 3)
    assert metrics["human_win_rate_weighted_round_0"] == pytest.approx(1 / 3)
    assert metrics["human_win_rate_weighted_round_1"] == 1.0
    assert metrics["human_win_rate_weighted"] == pytest.approx(4 / 6)
    assert metrics["agreement_reward"] == 0.75
    assert "  weighted human win-rate of challenger (round 1, 1 decided): 1.00" in lines


def test_tasks_without_judges_or_weights_add_no_figure():
    plain = [
        {
            **t,
            "meta": {
                "kubealign": {k: v for k, v in t["meta"]["kubealign"].items() if k not in ("judges", "weight", "round")}
            },
        }
        for t in EXPORT
    ]
    metrics: dict[str, float] = {}
    served_figures(plain, "challenger", metrics, [])
    assert metrics == {}


def test_the_run_summary_shows_the_pull_and_the_judges_agreement(tmp_path):
    from kubealign.cli.summary import summarize

    (tmp_path / "feedback").mkdir()
    metrics = {"rows": 9, "decided": 10, "human_win_rate": 0.7, "human_win_rate_low": 0.4, "human_win_rate_high": 0.9}
    metrics.update(agreement.figures({"heldout": agreement.Agreement(3, 4, 1, 0.3, 0.95)}))
    metrics["human_win_rate_weighted"] = 0.55
    result = {"stage": "feedback", "metrics": {**metrics, "wall_time_s": 1.5}}
    (tmp_path / "feedback" / "result.json").write_text(json.dumps(result))
    lines = summarize(tmp_path)
    assert lines[1].split(None, 3)[3] == (
        "9 rows from 10 decided tasks; human win-rate 0.70 (95 % 0.40-0.90), weighted 0.55"
    )
    assert lines[2].strip() == "judges' agreement with people: heldout 0.75 (0.30-0.95, 4 tasks)"
