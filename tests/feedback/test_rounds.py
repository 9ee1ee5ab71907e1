"""Round bookkeeping (issue 79): the next round's config from the last round's run.json (round + 1, the previous
round's MLflow pipeline run, then --set), the tags every MLflow run of a round carries, the judge output a round
pushes from, and the refusals of `kubealign round next` / `push` as one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubealign.config import config_to_json, load_config
from kubealign.errors import UserError
from kubealign.feedback import rounds

pytestmark = pytest.mark.unit


def run_json(root: Path, overrides: list[str], **extra) -> tuple[dict, Path]:
    config = load_config(None, overrides)
    index = {"config_json": config_to_json(config), "succeeded": True, "mlflow": {"parent_run_id": "0a1b2c"}}
    index["stages"] = {"judge": {"dir": str(root / "judge")}}
    index.update(extra)
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(json.dumps(index))
    return index, root


def test_the_next_round_counts_on_and_names_the_last(tmp_path):
    index, run = run_json(tmp_path / "r1", ["feedback.project=prefs", "feedback.round=1", "ppo.num_iterations=3"])
    config = rounds.next_config(index, run, ["feedback.budget=16"])
    assert (config.feedback.round, config.feedback.previous_run) == (2, "0a1b2c")
    assert config.feedback.budget == 16 and config.ppo.num_iterations == 3  # the last round's config, then --set
    assert config.feedback.round_tags == {"kubealign.round": "2", "kubealign.previous_run": "0a1b2c"}
    # a run id that YAML would read as a number stays the text it is
    index["mlflow"]["parent_run_id"] = "1e5"
    assert rounds.next_config(index, run, []).feedback.previous_run == "1e5"
    assert rounds.served_dir(index, run) == tmp_path / "r1" / "judge"
    assert load_config(None, []).feedback.round_tags == {"kubealign.round": "0"}  # round 0 names no previous run


@pytest.mark.parametrize(
    ("overrides", "extra", "message"),
    [
        (["feedback.project=prefs"], {"succeeded": False}, "that run did not succeed"),
        ([], {}, "feedback.project is not set: a round learns from people's choices"),
        (["feedback.project=prefs"], {"mlflow": {}}, "mlflow.parent_run_id is missing"),
    ],
)
def test_what_is_no_round_to_follow_is_one_line(tmp_path, overrides, extra, message):
    index, run = run_json(tmp_path / "r", overrides, **extra)
    with pytest.raises(UserError, match=message) as caught:
        rounds.next_config(index, run, [])
    assert str(caught.value).startswith(str(run / "run.json"))


def test_a_round_without_a_judge_has_nothing_served_to_push(tmp_path):
    index, run = run_json(tmp_path / "r", ["feedback.project=prefs"], stages={"promote": {"dir": "x"}})
    with pytest.raises(UserError, match="no judge task: nothing was served to push"):
        rounds.served_dir(index, run)


def test_round_next_refuses_in_one_line_and_writes_nothing(cli, tmp_path):
    _, run = run_json(tmp_path / "r", ["feedback.project=prefs"], succeeded=False)
    result = cli("round", "next", "--from", run, "--output", tmp_path / "r2")
    assert result.code == 2 and "that run did not succeed" in result.err
    assert len(result.err.strip().splitlines()) == 1 and not (tmp_path / "r2").exists()
    result = cli("round", "push", "--from", tmp_path / "nothing")
    assert result.code == 2 and "expected the --output of `kubealign run` (a round)" in result.err


@pytest.mark.rounds  # an MLflow store of its own: ~7 s, outside make test
def test_every_stage_run_of_a_round_is_tagged_with_it(tmp_path):
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import stage_run

    config = load_config(
        None, ["feedback.round=3", "feedback.previous_run=prev-run", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    )
    with stage_run("judge", config, tmp_path) as tracker:
        run_id = tracker.run_id
    tags = MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(run_id).data.tags
    assert (tags["kubealign.round"], tags["kubealign.previous_run"], tags["kubealign.stage"]) == (
        "3",
        "prev-run",
        "judge",
    )


def test_round_push_takes_a_judge_output_made_outside_the_dag(cli, tmp_path, monkeypatch):
    """A round served and judged by hand (as on a laptop: no judge task in its run.json): --judge names the output;
    its pairs go to the round's project with the round's number and budget."""
    from tests.feedback.standin import LabelStudioStandIn
    from tests.feedback.test_served import judge_dir

    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "t")
    sets = ["feedback.project=prefs", "feedback.round=2", "feedback.budget=3"]
    _, run = run_json(tmp_path / "r2", sets, stages={"promote": {"dir": "x"}})
    judged = judge_dir(tmp_path / "by-hand")
    with LabelStudioStandIn("t") as ls:
        refused = cli("round", "push", "--from", run, "--url", ls.url)
        assert refused.code == 2 and "no judge task: nothing was served to push" in refused.err
        done = cli("round", "push", "--from", run, "--url", ls.url, "--judge", judged)
        assert done.code == 0, done.err
        [project] = ls.store.projects.values()
    assert project["title"] == "prefs" and len(project["tasks"]) == 3  # the budget of the 4 served pairs
    assert {t["meta"]["kubealign"]["round"] for t in project["tasks"]} == {2}
    assert {t["meta"]["kubealign"]["judge_output"] for t in project["tasks"]} == {str(judged.resolve())}
    assert "round 2: 3 of 4 served pairs chosen (budget 3)" in done.out
