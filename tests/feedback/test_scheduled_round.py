"""A round on a schedule (issue 79): every run of a KFP recurring run starts from the same compiled config, so the
feedback task counts the round from the project (one after the last round whose served pairs people were sent,
never below the configured one; previous_run that round's judge run) and every later task reads the config it
outputs; after judge and act, a push task sends what the canary served to people, which closes the loop on a
cluster. Here: the count by hand, the push stage against the Label Studio stand-in, the compiled DAG's wiring, and
the feedback task through kfp.local tagging data-split's MLflow run with the counted round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from kubealign.config import load_config
from kubealign.errors import UserError
from kubealign.feedback import rounds, served
from kubealign.stages import push
from tests.feedback.standin import LabelStudioStandIn, annotate
from tests.feedback.test_client import registry_holding
from tests.feedback.test_served import judge_dir
from tests.pipelines.test_pipeline_compile import compiled, secret_names

TOKEN = "t"


def task(round_number, judge_run="j"):
    meta = {"answer1": "champion:1", "answer2": "challenger:2", "registered_model": "m"}
    if round_number is not None:
        meta.update(round=round_number, judge_run=judge_run)
    return {"meta": {"kubealign": meta}}


@pytest.mark.unit
def test_the_last_pushed_round_and_its_judge_run_are_read_from_the_project():
    tasks = [task(0, "a"), task(2, "c"), task(1, "b"), task(None), task(2, "c")]
    assert rounds.last_pushed(tasks) == (2, "c")
    # `feedback push` (no round) and a round that is no number say nothing; true is no round 1
    assert rounds.last_pushed([task(None), task("3"), task(True)]) is None
    assert rounds.last_pushed([]) is None
    # two judge runs in the last round: which one came before is not known, none is named
    assert rounds.last_pushed([task(1, "a"), task(1, "b"), task(0, "z")]) == (1, None)


@pytest.mark.unit
def test_the_round_counts_on_from_the_project_never_back():
    config = load_config(None, ["feedback.project=prefs", "feedback.round=1", "feedback.previous_run=r0"])
    on = rounds.counted(config, rounds.LastRound(2, "j2"))
    assert (on.feedback.round, on.feedback.previous_run) == (3, "j2")
    assert on.feedback.round_tags == {"kubealign.round": "3", "kubealign.previous_run": "j2"}
    # `round next` already counted (configured 3 after round 2 was pushed), or a round ahead: as configured
    assert rounds.counted(config, rounds.LastRound(0, "j0")) is config
    level = load_config(None, ["feedback.project=prefs", "feedback.round=3"])
    assert rounds.counted(level, rounds.LastRound(2, "j2")) is level
    assert rounds.counted(config, None) is config
    assert config.feedback.round == 1  # the given config is not changed


@pytest.mark.unit
def test_the_push_stage_sends_the_served_pairs_with_the_round(tmp_path, monkeypatch):
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    judged = judge_dir(tmp_path)
    config = load_config(None, ["feedback.project=prefs", "feedback.round=4", "feedback.budget=2"])
    with LabelStudioStandIn(TOKEN) as ls:
        monkeypatch.setenv("LABEL_STUDIO_URL", ls.url)  # as the DAG pins it
        result = push.run(config, judged, tmp_path / "pushed")
        [project] = ls.store.projects.values()
        again = push.run(config, judged, tmp_path / "again")
    assert project["title"] == "prefs" and len(project["tasks"]) == 2
    assert {t["meta"]["kubealign"]["round"] for t in project["tasks"]} == {4}
    assert result["metrics"] == {
        "tasks_added": 2,
        "tasks_present": 0,
        "pairs_served": 4,
        "pairs_alike": 0,
        "round": 4,
    }
    assert json.loads((tmp_path / "pushed" / "result.json").read_text())["judge_run"] == "run-j1"
    assert (again["metrics"]["tasks_added"], again["metrics"]["tasks_present"]) == (0, 2)  # nothing twice


@pytest.mark.unit
def test_the_push_stage_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("LABEL_STUDIO_API_KEY", raising=False)
    with pytest.raises(UserError, match="feedback.project: not set"):
        push.run(load_config(None, []), judge_dir(tmp_path), tmp_path / "out")
    with pytest.raises(UserError, match="LABEL_STUDIO_API_KEY is not set"):
        push.run(load_config(None, ["feedback.project=prefs"]), judge_dir(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def given(spec, name: str, field: str):
    return spec.root.dag.tasks[name].inputs.parameters[field]


@pytest.mark.kfp
def test_the_dag_pushes_after_act_and_reads_the_counted_config(tmp_path: Path) -> None:
    sets = ["feedback.project=prefs", "feedback.token_secret=ls-token", "serve.enabled=true", "promote.mode=canary"]
    spec, platform = compiled(tmp_path, sets)
    tasks = spec.root.dag.tasks
    assert set(tasks["push"].dependent_tasks) == {"feedback", "judge", "act"}
    source = tasks["push"].inputs.artifacts["judgement"].task_output_artifact
    assert (source.producer_task, source.output_artifact_key) == ("judge", "judgement")
    assert not tasks["push"].caching_options.enable_cache
    # the Label Studio token and nothing else: it runs no user code and logs no run
    assert secret_names(platform, "push") == {"ls-token"}
    executors = json_format.MessageToDict(spec.deployment_spec)["executors"]
    env = {e["name"]: e.get("value", "") for e in executors["exec-push"]["container"]["env"]}
    assert env["LABEL_STUDIO_URL"] == "http://label-studio-ls-app:80"
    # every task after the pull reads the config it output; the pull reads the run's parameter
    assert given(spec, "feedback", "config_json").component_input_parameter == "config_json"
    for name in ("data-split", "sft", "reward", "promote", "serve", "judge", "act", "push"):
        output = given(spec, name, "config_json").task_output_parameter
        assert (output.producer_task, output.output_parameter_key) == ("feedback", "Output"), name
    spec, _ = compiled(tmp_path, ["serve.enabled=true", "promote.mode=canary"])
    assert "push" not in spec.root.dag.tasks  # no project: nothing to push to
    assert given(spec, "data-split", "config_json").component_input_parameter == "config_json"
    spec, _ = compiled(tmp_path, [*sets, "canary.act=false"])
    assert set(spec.root.dag.tasks["push"].dependent_tasks) == {"feedback", "judge"}


@pytest.mark.kfp
def test_a_scheduled_run_counts_its_round_from_the_project(tmp_path, monkeypatch) -> None:
    """The compiled config says round 0; the project holds round 1's served pairs, two of them decided: the
    feedback task's run and data-split's are tagged round 2, after round 1's judge run."""
    from kfp import dsl, local
    from kfp.dsl import Dataset
    from mlflow import MlflowClient

    from kubealign.feedback.client import LabelStudio
    from kubealign.feedback.pairs import LABEL_CONFIG
    from kubealign.pipelines import dag

    registry = registry_holding(tmp_path, 4)  # the judge output's versions 3 and 4, checked by the pull
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    got = served.served_tasks(judge_dir(tmp_path), "kubealign-actor", 4, 0.0, seed=1, round_number=1)
    with LabelStudioStandIn(TOKEN) as ls:
        LabelStudio(ls.url, TOKEN).create_project("prefs", LABEL_CONFIG)
        ls.store.add_tasks(1, got.tasks)
        annotate(ls.store.projects[1]["tasks"][:2], lambda p, t: len(t), noise=0.0, skip=0.0, seed=0)
        config = load_config(
            None,
            [
                "data.synthetic_pairs=200",
                "data.synthetic_sft_rows=10",
                "feedback.project=prefs",
                f"feedback.url={ls.url}",
            ],
        )
        defaults = dag.pipeline_defaults(config)
        builder = dag.Tasks(config, None, defaults["reward_functions"])

        def people_first(config_json=defaults["config_json"], fingerprint=defaults["data_fingerprint"]):
            return builder.data({"config_json": config_json, "data_fingerprint": fingerprint})

        people_first.__annotations__ = {"config_json": str, "fingerprint": str, "return": Dataset}
        root = str(tmp_path / "root")
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=root, raise_on_error=True)
        dsl.pipeline(people_first)()
    client = MlflowClient(registry)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    tags = {r.data.tags["kubealign.stage"]: r.data.tags for r in runs}
    assert set(tags) == {"feedback", "data-split"}
    for stage in ("feedback", "data-split"):
        assert (tags[stage]["kubealign.round"], tags[stage]["kubealign.previous_run"]) == ("2", "run-j1"), stage
    (pulled,) = [r for r in runs if r.data.tags["kubealign.stage"] == "feedback"]
    assert pulled.data.metrics["decided"] == 2


@pytest.mark.unit
def test_the_scripted_person_skips_a_pair_it_finds_equally_good_when_asked():
    """The rehearsal's person (benchmarks/feedback_rounds.py): level answers are skipped, not given to the left one;
    by default (the rounds tier) the left answer takes a level pair, as before."""

    def tasks():
        pair = {"prompt": "p", "answer1": "aa", "answer2": "bb"}  # level by length
        return [{"data": pair, "annotations": []}, {"data": {**pair, "answer2": "bbb"}, "annotations": []}]

    asked = tasks()
    counts = annotate(asked, lambda p, t: len(t), noise=0.0, skip=0.0, seed=0, skip_level=True)
    assert counts == {"chose": 1, "flipped": 0, "skipped": 0, "level": 1}
    assert asked[0]["annotations"][0]["was_cancelled"] and asked[0]["annotations"][0]["result"] == []
    assert asked[1]["annotations"][0]["result"][0]["value"] == {"selected": "right"}
    plain = tasks()
    assert annotate(plain, lambda p, t: len(t), noise=0.0, skip=0.0, seed=0)["chose"] == 2
    assert plain[0]["annotations"][0]["result"][0]["value"] == {"selected": "left"}
