"""Two rounds through kfp.local (issue 79, marker rounds): round 0 pulls an empty project and promotes; the pairs a
judge served go to people (a Label Studio stand-in and a scripted annotator); `kubealign round next` runs round 1
from round 0's output, which pulls those choices and trains on them. Every MLflow run of round 1 carries its round
and round 0's pipeline run, and the registered version's lineage leads to the exact file of labels that trained it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kubealign.feedback.client import LabelStudio
from kubealign.feedback.pairs import LABEL_CONFIG
from tests.feedback.standin import LabelStudioStandIn, annotate
from tests.feedback.test_client import registry_holding
from tests.feedback.test_feedback_task import SHORT, SMALL
from tests.feedback.test_rounds_loop import served

pytestmark = pytest.mark.rounds
TOKEN = "rounds-token"


def test_round_next_learns_from_the_pushed_choices_and_says_which_round_it_is(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from kubealign.cli import main

    uri = registry_holding(tmp_path, 2)  # versions 1 and 2: the served pairs' champion and canary
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    with LabelStudioStandIn(TOKEN) as ls:
        LabelStudio(ls.url, TOKEN).create_project("prefs", LABEL_CONFIG)
        settings = [*SMALL, *SHORT, "feedback.project=prefs", f"feedback.url={ls.url}", "feedback.budget=16"]
        first, second = tmp_path / "round-0", tmp_path / "round-1"
        assert main(["run", *(a for s in settings for a in ("--set", s)), "--output", str(first)]) == 0
        zero = json.loads((first / "run.json").read_text())
        assert json.loads(Path(zero["stages"]["feedback"]["dir"], "result.json").read_text())["metrics"]["rows"] == 0
        push = ["feedback", "push", "--from-judge", str(served(tmp_path, 30)), "--project", "prefs", "--url", ls.url]
        assert main(push) == 0
        done = annotate(
            ls.store.projects[1]["tasks"], lambda prompt, text: len(text.split()), noise=0.1, skip=0.1, seed=1
        )
        assert main(["round", "next", "--from", str(first), "--output", str(second)]) == 0
    capsys.readouterr()
    one = json.loads((second / "run.json").read_text())
    before, parent = zero["mlflow"]["parent_run_id"], one["mlflow"]["parent_run_id"]
    client = MlflowClient(uri)
    runs = client.search_runs([one["mlflow"]["experiment_id"]], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert {r.data.tags["kubealign.stage"] for r in runs} >= {"feedback", "data-split", "reward", "promote"}
    for run in [*runs, client.get_run(parent)]:
        assert (run.data.tags["kubealign.round"], run.data.tags["kubealign.previous_run"]) == ("1", before)
    assert client.get_run(before).data.tags["kubealign.round"] == "0"
    # the labels: round 1's pull holds the annotator's decided choices (a task the person chose between two equal
    # lengths still counts: it is decided) and data-split read that very file
    pulled = Path(one["stages"]["feedback"]["dir"]) / "human.jsonl"
    rows = pulled.read_text().splitlines()
    assert len(rows) == done["chose"] > 8
    digest = hashlib.sha256(pulled.read_bytes()).hexdigest()
    sources = json.loads(Path(one["stages"]["data-split"]["dir"], "manifest.json").read_text())["sources"]
    assert [(Path(s["path"]).name, s["sha256"], s["rows_read"]) for s in sources][-1] == (
        "human.jsonl",
        digest,
        len(rows),
    )
    # and they train round 1's reward model: every decided choice is a pair of phase 2's train split
    from kubealign.data import phases

    trained = phases.load(Path(one["stages"]["data-split"]["dir"]), "phase2_reward")["train"]
    people = {(json.loads(r)["prompt"], json.loads(r)["chosen"]) for r in rows}
    assert people <= set(zip(trained["prompt"], trained["chosen"], strict=True))
    # lineage: the version round 1 registered -> its pipeline run -> that run's feedback run -> the file's digest
    promoted = json.loads(Path(one["stages"]["promote"]["dir"], "result.json").read_text())
    version = client.get_model_version(promoted["registered_model"], str(promoted["version"]))
    assert version.tags["kubealign.pipeline_run_id"] == parent
    [feedback] = [r for r in runs if r.data.tags["kubealign.stage"] == "feedback"]
    assert [d.dataset.digest for d in feedback.inputs.dataset_inputs] == [digest[:36]]  # MLflow keeps 36
    assert feedback.data.metrics["agreement_reward_n"] > 0  # the judges checked against these choices, in round 1
    # the picture across rounds: round 0's served pairs, in the task's output and its MLflow run
    table = (pulled.parent / "rounds.md").read_text()
    assert table.splitlines()[4].startswith("| 0 | ") and (pulled.parent / "rounds.png").stat().st_size > 1000
    assert {"feedback/rounds.png", "feedback/rounds.md"} <= {
        a.path for a in client.list_artifacts(feedback.info.run_id, "feedback")
    }
