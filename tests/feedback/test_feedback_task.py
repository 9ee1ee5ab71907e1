"""The pipeline's `feedback` task (issue 59): with feedback.project set, the DAG pulls people's choices before
data-split (never cached, with the Label Studio token from its Secret and the tracking identity) and data-split
reads them as one more source, weighted by feedback.weight; without it, the DAG is as before. The task runs
through kfp.local against the recorded Label Studio exchange (tests/feedback/recorded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from google.protobuf import json_format

from kubealign import tasks
from kubealign.config import config_to_json, load_config
from kubealign.data import phases
from tests.feedback.test_client import PULL, RECORDED, TOKEN, registry_holding, replay_pull  # noqa: F401  (the fixture)
from tests.pipelines.test_pipeline_compile import compiled, secret_names

pytestmark = pytest.mark.kfp
SMALL = ["data.synthetic_pairs=200", "data.synthetic_sft_rows=10"]


def test_the_dag_pulls_before_data_split_only_when_asked(tmp_path: Path) -> None:
    spec, platform = compiled(tmp_path, ["feedback.project=prefs", "feedback.token_secret=ls-token"])
    tasks_ = spec.root.dag.tasks
    given = tasks_["data-split"].inputs.artifacts["feedback"].task_output_artifact
    assert (given.producer_task, given.output_artifact_key) == ("feedback", "dataset")
    assert not tasks_["feedback"].inputs.artifacts  # it reads Label Studio, nothing of the DAG's
    assert not tasks_["feedback"].caching_options.enable_cache  # people keep choosing: pull again every run
    assert tasks_["data-split"].caching_options.enable_cache
    token = [
        (s.secret_name, [(k.secret_key, k.env_var) for k in s.key_to_env])
        for s in platform["exec-feedback"].secret_as_env
    ]
    assert ("ls-token", [("LABEL_STUDIO_API_KEY", "LABEL_STUDIO_API_KEY")]) in token
    assert secret_names(platform, "feedback") == {"ls-token", "kubealign-mlflow-tracker"}  # logs runs, moves nothing
    assert "ls-token" not in secret_names(platform, "data-split") | secret_names(platform, "promote")
    # where the token goes is pinned at compile time: a run's edited config_json cannot move it
    executors = json_format.MessageToDict(spec.deployment_spec)["executors"]
    env = {e["name"]: e.get("value", "") for e in executors["exec-feedback"]["container"]["env"]}
    assert env["LABEL_STUDIO_URL"] == "http://label-studio-ls-app:80"
    spec, platform = compiled(tmp_path, [])
    assert "feedback" not in spec.root.dag.tasks and "exec-feedback" not in platform
    assert "feedback" not in spec.root.dag.tasks["data-split"].inputs.artifacts


def test_a_feedback_url_that_is_no_url_is_one_line_naming_the_field() -> None:
    from kubealign.errors import UserError

    with pytest.raises(UserError, match=r"field 'feedback.url' \(from --set\): expected an http\(s\) URL"):
        load_config(None, ["feedback.url=label-studio:80"])
    assert load_config(None, ["feedback.url=https://ls.example.com"]).feedback.url == "https://ls.example.com"


def people_dir(root: Path, rows: list[dict]) -> Path:
    out = root / "feedback"
    out.mkdir(parents=True)
    (out / "human.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "result.json").write_text(json.dumps({"stage": "feedback", "metrics": {}, "outputs": {}}))
    return out


def all_prompts(split: Path) -> list[str]:
    found = []
    for phase in ("phase1_sft", "phase2_reward", "phase3_prompts"):
        for part in phases.load(split, phase).values():
            found += part["prompt"]
    return found


def test_data_split_trains_the_reward_model_on_the_pulled_rows_by_weight_and_leaves_an_empty_pull_out(
    tmp_path: Path,
) -> None:
    rows = [{"prompt": f"people {i}?", "chosen": f"a fine answer {i}", "rejected": f"no {i}"} for i in range(40)]
    pulled = people_dir(tmp_path / "pulled", rows)
    counted = {}
    for weight in (1, 3):
        config = config_to_json(load_config(None, [*SMALL, f"feedback.weight={weight}", "tracking.enabled=false"]))
        split = tmp_path / f"split-{weight}"
        tasks.data_split(config, [], str(split), str(pulled))
        sources = json.loads((split / "manifest.json").read_text())["sources"]
        assert [(Path(s["path"]).name, s["rows_read"]) for s in sources] == [("synthetic", 210), ("human.jsonl", 40)]
        prompts = all_prompts(split)
        trained = phases.load(split, "phase2_reward")["train"]["prompt"]
        counted[weight] = sum(p.startswith("people ") for p in trained)
        # people's choices train the reward model, every one (weight times): none in another phase or an eval split
        assert sum(p.startswith("people ") for p in prompts) == counted[weight]
    assert (counted[1], counted[3]) == (40, 120)
    empty = people_dir(tmp_path / "nobody", [])
    config = config_to_json(load_config(None, [*SMALL, "tracking.enabled=false"]))
    tasks.data_split(config, [], str(tmp_path / "split-none"), str(empty))
    sources = json.loads((tmp_path / "split-none" / "manifest.json").read_text())["sources"]
    assert [Path(s["path"]).name for s in sources] == ["synthetic"]  # nothing decided yet: no source of none


def test_the_feedback_task_runs_in_kfp_local_and_feeds_data_split(replay_pull, tmp_path, monkeypatch) -> None:  # noqa: F811
    from kfp import dsl, local
    from kfp.dsl import Dataset
    from mlflow import MlflowClient

    from kubealign.pipelines import dag

    registry = registry_holding(tmp_path, 4)  # the recorded tasks' versions, checked by the pull
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    settings = [*SMALL, "feedback.project=kubealign-feedback", f"feedback.url={replay_pull}"]
    config = load_config(None, settings)
    defaults = dag.pipeline_defaults(config)
    builder = dag.Tasks(config, None, defaults["reward_functions"])

    def people_first(config_json=defaults["config_json"], fingerprint=defaults["data_fingerprint"]):
        return builder.data({"config_json": config_json, "data_fingerprint": fingerprint})

    # KFP reads the annotations as objects (this module's are strings: `from __future__ import annotations`)
    people_first.__annotations__ = {"config_json": str, "fingerprint": str, "return": Dataset}
    pipeline = dsl.pipeline(people_first)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=True)
    # a run that edits config_json to send the token elsewhere: the task still asks the compiled address
    edited = json.loads(defaults["config_json"])
    edited["feedback"]["url"] = "http://127.0.0.1:9"
    split = Path(pipeline(config_json=json.dumps(edited)).output.path)
    from tests.feedback.test_client import Replay

    assert Replay.calls == [] and set(Replay.seen) == {f"Token {TOKEN}"}  # found the project, exported it
    sources = json.loads((split / "manifest.json").read_text())["sources"]
    assert [(Path(s["path"]).name, s["rows_read"]) for s in sources] == [("synthetic", 210), ("human.jsonl", 2)]
    pushed = RECORDED["pushed"]
    assert {pushed[0]["data"]["prompt"], pushed[1]["data"]["prompt"]} <= set(all_prompts(split))
    client = MlflowClient(registry)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    stages = sorted(r.data.tags.get("kubealign.stage", "") for r in runs)
    assert stages == ["data-split", "feedback"], stages
    (feedback,) = [r for r in runs if r.data.tags.get("kubealign.stage") == "feedback"]
    assert feedback.data.metrics["decided"] == 2 and feedback.data.metrics["skipped"] == 1
    assert feedback.data.tags["kubealign.feedback.registered_model"] == "kubealign-actor"
    (given,) = feedback.inputs.dataset_inputs
    (split_run,) = [r for r in runs if r.data.tags.get("kubealign.stage") == "data-split"]
    assert given.dataset.digest in {d.dataset.digest for d in split_run.inputs.dataset_inputs}  # the lineage


SHORT = [
    "sft.num_train_epochs=1",
    "reward.num_train_epochs=1",
    "ppo.num_iterations=1",
    "evaluate.max_prompts=4",
    "promote.min_win_rate=0",
    "promote.min_reward_gain=-100",
    "promote.min_win_rate_lower_bound=null",
]


@pytest.mark.rounds  # the feedback task pulled through the whole DAG: the rounds tier (make test-rounds), outside make test
def test_kubealign_run_pulls_first_and_a_rerun_reuses_the_pull(replay_pull, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`kubealign run` with feedback.project: the feedback task first, its output in run.json and the summary; a
    rerun of data-split reads the run's pulled file and asks Label Studio nothing (the recording holds one pull).
    The run tracks to the registry the tasks were pushed from (it holds their versions: the pull checks them)."""
    from kubealign.cli import main
    from tests.feedback.test_client import Replay

    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry_holding(tmp_path, 4))
    settings = [*SMALL, *SHORT, "feedback.project=kubealign-feedback", f"feedback.url={replay_pull}"]
    out = tmp_path / "run"
    assert main(["run", *(a for s in settings for a in ("--set", s)), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    index = json.loads((out / "run.json").read_text())
    assert list(index["stages"])[:2] == ["feedback", "data-split"] and index["succeeded"]
    pulled = Path(index["stages"]["feedback"]["dir"])
    assert json.loads((pulled / "result.json").read_text())["metrics"]["decided"] == 2
    assert Replay.calls == []
    assert re.search(r"^\s*feedback\b.*done", printed, re.M), printed
    rerun = tmp_path / "rerun"
    assert main(["rerun", "data-split", "--from", str(out), "--output", str(rerun)]) == 0
    again = json.loads((rerun / "run.json").read_text())
    assert again["reused"] == ["feedback"] and Replay.calls == []
    sources = json.loads((rerun / "data-split" / "manifest.json").read_text())["sources"]
    assert [(Path(s["path"]).name, s["rows_read"]) for s in sources] == [("synthetic", 210), ("human.jsonl", 2)]
