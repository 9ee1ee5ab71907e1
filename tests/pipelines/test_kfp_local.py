"""The whole DAG through kfp.local (SubprocessRunner) on the tiny preset, shortened: what `kubealign run`
prints and the task logs it writes, a champion in a temporary MLflow registry, one parent run with a
nested run per task, the local cache, and `kubealign rerun` on the run's artifacts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubealign.cli import main
from kubealign.outputs import tree_sha256
from kubealign.shape import downstream_of

pytestmark = [pytest.mark.kfp, pytest.mark.integration]

SHORT = [
    "sft.num_train_epochs=2",
    "reward.num_train_epochs=1",
    "ppo.num_iterations=3",
    "evaluate.max_prompts=8",
    # a gate any candidate passes: this test is about the wiring to the registry, not about quality
    "promote.min_win_rate=0",
    "promote.min_reward_gain=-100",
    "promote.min_win_rate_lower_bound=null",
]
STAGES = ["data-split", "sft", "reward", "ppo", "evaluate", "promote"]


def overrides() -> list[str]:
    return [arg for item in SHORT for arg in ("--set", item)]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """`kubealign run` as a person starts it: a process of its own, its stdout a pipe (not a terminal),
    and progress bars on (the test session disables them). Returns (output dir, run.json, what it printed)."""
    out = tmp_path_factory.mktemp("kfp-local") / "run"
    # Run from a process that holds a rendezvous port (as one that ran a stage in-process, or runs under
    # torchrun, does): the tasks must not inherit MASTER_PORT and fail to bind it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "1", "RANK": "0"})
        # without --cache, as `make demo` runs: it still records its tasks for the next --cache run
        command = [sys.executable, "-m", "kubealign.cli", "run", *overrides(), "--output", str(out)]
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout
    return out, json.loads((out / "run.json").read_text(encoding="utf-8")), done.stdout


def test_run_prints_a_line_per_task_then_the_summary(first_run) -> None:
    out, _, printed = first_run
    lines = printed.splitlines()
    assert len(lines) <= 40, printed
    # not a terminal: one line per state change, no carriage-return redraws
    assert "\r" not in printed and "\x1b" not in printed
    tasks = lines[: lines.index("")]  # the task lines, then a blank line and the summary
    assert len(tasks) == 2 * len(STAGES)  # (sft and reward may run in either order)
    for stage in STAGES:
        assert [line.split()[1] for line in tasks if line.split()[0] == stage] == ["running", "done"], stage
    assert not [line for line in lines if re.search(r"warning", line, re.IGNORECASE)], printed
    assert any(line.startswith("stage ") for line in lines)  # the summary table
    assert f"task logs: {out.resolve() / 'logs'}/<task>.log" in lines
    report = [line.strip().removeprefix("report: ") for line in lines if line.strip().startswith("report: ")]
    assert len(report) == 1 and report[0].endswith("/evaluate/evaluation/samples.html"), printed
    assert Path(report[0]).is_file()  # relative to the working directory (this one) or absolute


def test_each_task_writes_its_full_output_to_its_log(first_run) -> None:
    out, index, _ = first_run
    for stage in STAGES:
        log = (out / "logs" / f"{stage}.log").read_text(encoding="utf-8")
        component = stage.replace("-", "_")
        assert f"Looking for component `{component}`" in log, stage  # the executor's own first lines
        assert f"/{stage}/executor_output.json" in log, stage  # ... and its last
    for stage, bar in (("sft", "sft: 100%|"), ("reward", "reward: 100%|"), ("ppo", "ppo: 100%|")):
        assert bar in (out / "logs" / f"{stage}.log").read_text(encoding="utf-8"), stage
    # what kfp.local says about each task (start, status, outputs) is kept too
    assert "finished with status" in (out / "logs" / "kfp-local.log").read_text(encoding="utf-8")


def test_no_warnings_that_have_a_fix_at_their_source(first_run) -> None:
    out, _, _ = first_run
    logs = "".join(path.read_text(encoding="utf-8") for path in (out / "logs").glob("*.log"))
    for fixed in (
        "Add type hints to the `predict` method",  # registry.ActorModel.predict has them
        "An input example was not provided",  # promote.register logs one
        "serialized using CloudPickle",  # the model is logged from code
        "Setting accelerator to CPU",  # DS_ACCELERATOR=cpu (training/engine.py)
        "E2E latency",  # the hybrid engine's timing print goes to the debug log
    ):
        assert fixed not in logs, fixed


def test_local_run_registers_a_champion(first_run) -> None:
    out, index, _ = first_run
    assert index["succeeded"] and list(index["stages"]) == STAGES
    promote = json.loads((Path(index["stages"]["promote"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    assert promote["aliases"]["champion"] == promote["version"] == 1
    # the held-out reward model the reward task trained beside the main one judged the candidate too (issue 53)
    assert (Path(index["stages"]["reward"]["dir"]) / "heldout" / "model.safetensors").is_file()
    evaluation = json.loads((Path(index["stages"]["evaluate"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    evaluation = evaluation["metrics"]
    assert [line.split(" (")[0] for line in promote["gate"] if "held-out reward model" in line] == [
        f"pass: held-out reward model: win-rate: needs >= 0.0, got {evaluation['heldout_win_rate']:.3f}"
    ]
    client = MlflowClient(index["mlflow"]["tracking_uri"])
    assert index["mlflow"]["tracking_uri"] == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    assert client.get_model_version_by_alias("kubealign-actor", "champion").version in (1, "1")
    # every stage wrote its result where the index says, and the hash is of what is there now
    for stage, entry in index["stages"].items():
        assert json.loads((Path(entry["dir"]) / "result.json").read_text(encoding="utf-8"))["stage"] == stage
        assert tree_sha256(Path(entry["dir"])) == entry["sha256"]


def test_one_parent_mlflow_run_with_a_nested_run_per_task(first_run) -> None:
    _, index, _ = first_run
    client = MlflowClient(index["mlflow"]["tracking_uri"])
    parent = client.get_run(index["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["kubealign.stage"] == "pipeline"
    children = client.search_runs(
        [index["mlflow"]["experiment_id"]], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(r.data.tags["kubealign.stage"] for r in children) == sorted(STAGES)
    sft = next(r for r in children if r.data.tags["kubealign.stage"] == "sft")
    assert sft.data.params["sft.num_train_epochs"] == "2.0"  # the task got the run's config
    assert sft.data.metrics["after_perplexity"] < sft.data.metrics["before_perplexity"]


def test_second_run_reuses_cached_tasks_except_promote(first_run, tmp_path: Path, capsys) -> None:
    """The first run ran without --cache (as `make demo`): a --cache run after it reuses every task."""
    out, index, _ = first_run
    again = tmp_path / "again"
    assert main(["run", *overrides(), "--output", str(again), "--cache"]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = sorted(" ".join(line.split()[:2]) for line in printed[: printed.index("")])
    # promote is never cached: the registry is outside KFP's view
    assert shown == sorted([*(f"{stage} cached" for stage in STAGES[:-1]), "promote running", "promote done"])
    assert "not run; kfp.local's cache held its outputs" in (again / "logs" / "sft.log").read_text(encoding="utf-8")
    second = json.loads((again / "run.json").read_text(encoding="utf-8"))
    for stage in STAGES[:-1]:  # same inputs -> the same artifact directories, not recomputed
        assert second["stages"][stage]["dir"] == index["stages"][stage]["dir"], stage
    assert second["stages"]["promote"]["dir"] != index["stages"]["promote"]["dir"]
    assert second["wall_time_s"] < index["wall_time_s"] / 3


# One RL variant besides ppo (grpo takes the same path, the ppo task's `algorithm` parameter; it runs through
# the DAG as a branch in tests/pipelines/test_routes.py and as this run's rerun below) and dpo, a task of its own.
@pytest.mark.parametrize("algorithm", ["rloo", "dpo"])
def test_each_route_runs_through_the_dag_and_is_tagged_in_the_registry(first_run, tmp_path: Path, algorithm) -> None:
    _, index, _ = first_run
    target = tmp_path / algorithm
    chosen = f"pipeline.candidates=[{{route: {algorithm}}}]"
    assert main(["run", *overrides(), "--set", chosen, "--output", str(target), "--cache"]) == 0
    routed = json.loads((target / "run.json").read_text(encoding="utf-8"))
    candidate = "dpo" if algorithm == "dpo" else "ppo"
    assert routed["succeeded"] and routed["algorithm"] == algorithm
    assert list(routed["stages"]) == ["data-split", "sft", "reward", candidate, "evaluate", "promote"]
    # the route is the `algorithm` parameter, not part of config_json: the tasks before the branch are the
    # first run's, from kfp.local's cache
    for stage in ("data-split", "sft", "reward"):
        assert routed["stages"][stage]["dir"] == index["stages"][stage]["dir"], stage
    made = json.loads((Path(routed["stages"][candidate]["dir"]) / "result.json").read_text(encoding="utf-8"))
    assert made["stage"] == candidate
    if candidate == "ppo":
        assert made["algorithm"] == algorithm
    evaluation = json.loads((Path(routed["stages"]["evaluate"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    assert evaluation["models"]["candidate"] == routed["stages"][candidate]["dir"]
    promoted = json.loads((Path(routed["stages"]["promote"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    client = MlflowClient(routed["mlflow"]["tracking_uri"])
    version = client.get_model_version("kubealign-actor", str(promoted["version"]))
    assert version.tags["kubealign.algorithm"] == algorithm


def test_rerun_ppo_reuses_that_runs_sft_and_reward(first_run, tmp_path: Path, capsys) -> None:
    out, index, _ = first_run
    target = tmp_path / "ppo-again"
    code = main(["rerun", "ppo", "--from", str(out), "--set", "ppo.num_iterations=2", "--output", str(target)])
    assert code == 0
    assert "reused data-split, reward, sft" in capsys.readouterr().out
    new = json.loads((target / "run.json").read_text(encoding="utf-8"))
    assert new["rerun"] == ["ppo"] and new["reused"] == ["data-split", "reward", "sft"]
    for stage in ("data-split", "sft", "reward"):  # the very same inputs, byte for byte
        assert new["stages"][stage] == index["stages"][stage]
        assert tree_sha256(Path(new["stages"][stage]["dir"])) == index["stages"][stage]["sha256"]
    ppo = json.loads((target / "ppo" / "result.json").read_text(encoding="utf-8"))
    assert len(ppo["history"]) == 2  # the override applied
    assert new["stages"]["ppo"]["sha256"] != index["stages"]["ppo"]["sha256"]
    assert tree_sha256(Path(index["stages"]["ppo"]["dir"])) == index["stages"]["ppo"]["sha256"]  # old run untouched
    client = MlflowClient(new["mlflow"]["tracking_uri"])
    assert (
        client.get_run(new["mlflow"]["parent_run_id"]).data.tags["kubealign.rerun_of"]
        == index["mlflow"]["parent_run_id"]
    )


# No KL penalty, a learning rate 50 times the default, long enough to find the reward model's exploit (issue 53):
# measured from this run's SFT model, PPO's answers become one word repeated to the token limit and GRPO's
# twice as long and repetitive, both winning 75-100 % of the prompts by the reward model.
HACKED = ["ppo.kl_coef=0", "ppo.kl_target=null", "ppo.actor_learning_rate=5e-3"]


@pytest.mark.parametrize(("route", "iterations"), [("ppo", 15), ("grpo", 10)])
def test_a_reward_hacked_policy_is_refused_by_a_guard(first_run, tmp_path: Path, capsys, route, iterations) -> None:
    out, _, _ = first_run
    sets = [*HACKED, f"ppo.num_iterations={iterations}", f"ppo.algorithm={route}"]
    target = tmp_path / f"hacked-{route}"
    args = ["rerun", "ppo", "--from", str(out), "--downstream", "--output", str(target)]
    assert main([*args, *(arg for item in sets for arg in ("--set", item))]) == 0
    printed = capsys.readouterr().out
    index = json.loads((target / "run.json").read_text(encoding="utf-8"))
    evaluation = json.loads((Path(index["stages"]["evaluate"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    promoted = json.loads((Path(index["stages"]["promote"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    m = evaluation["metrics"]
    assert m["reward_gain"] > 1.0 and m["win_rate"] >= 0.5  # by the reward model it trained against: a success
    # every reward check passed (this run's gate asks little); a guard refused it, said in one line
    assert all(
        line.startswith(("pass: ", "unchecked: "))
        for line in promoted["gate"]
        if "degeneration" not in line and "capability" not in line
    )
    assert promoted["metrics"]["gate_passed"] == 0.0 and promoted["aliases"]["champion"] is None
    refusal = promoted["refusal"]
    assert refusal.startswith("gate refused: capability: held-out log-likelihood per token ")
    assert refusal.endswith(
        f"the training reward model's gain {m['reward_gain']:+.3f} is not trusted (reward hacking suspected)"
    )
    assert refusal in printed  # the run's summary says it


def test_rerun_refuses_inputs_that_changed(cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    dirs = {}
    for stage in ("data-split", "sft", "reward"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "result.json").write_text("{}", encoding="utf-8")
        dirs[stage] = {"dir": str(tmp_path / stage), "sha256": tree_sha256(tmp_path / stage)}
    (run / "run.json").write_text(json.dumps({"config_json": "{}", "stages": dirs}), encoding="utf-8")
    (tmp_path / "sft" / "model.safetensors").write_bytes(b"edited after the run")
    result = cli("rerun", "ppo", "--from", run)
    assert result.code == 2 and "sft output changed or vanished" in result.err
    assert cli("rerun", "ppo", "--from", tmp_path / "nowhere").code == 2


def test_downstream_order() -> None:
    assert downstream_of("sft") == ["ppo", "evaluate", "promote"]
    assert downstream_of("data-split") == STAGES[1:]
    assert downstream_of("promote") == []


def test_a_failing_task_fails_the_run_in_one_line(cli, tmp_path: Path) -> None:
    # there (a missing file is refused before the run) and valid JSON lines (read when compiling), but no
    # row data-split can use
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n', encoding="utf-8")
    result = cli("run", "--set", f"data.sources=[{{path: {bad}}}]", "--output", tmp_path / "r")
    assert result.code == 2
    log = tmp_path / "r" / "logs" / "data-split.log"
    [line] = result.err.splitlines()  # one line, no traceback: the task, its last error line, its log
    assert line.startswith("kubealign: error: task data-split failed: UserError: ") and str(bad) in line
    assert line.endswith(f" (log: {log})")
    assert "Traceback (most recent call last)" in log.read_text(encoding="utf-8")  # the whole story is there
    assert [line.split()[:2] for line in result.out.splitlines()] == [
        ["data-split", "running"],
        ["data-split", "FAILED"],
        *([stage, "skipped"] for stage in STAGES[1:]),  # said so, not left pending
    ]
    assert result.out.splitlines()[1].endswith(f"; log: {log}")
    index = json.loads((tmp_path / "r" / "run.json").read_text(encoding="utf-8"))
    assert index["succeeded"] is False and index["stages"] == {}


def test_verbose_streams_the_tasks_output_and_still_writes_the_logs(cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n', encoding="utf-8")
    result = cli("run", "--verbose", "--set", f"data.sources=[{{path: {bad}}}]", "--output", tmp_path / "r")
    assert result.code == 2 and result.err.splitlines()[-1].startswith("kubealign: error: task data-split failed: ")
    assert "Looking for component `data_split`" in result.out and "Traceback (most recent call last)" in result.out
    assert "finished with status" in result.out  # kfp.local's own lines, as without kubealign's display
    assert "Traceback (most recent call last)" in (tmp_path / "r" / "logs" / "data-split.log").read_text(
        encoding="utf-8"
    )


def test_run_without_tracking_is_refused_before_anything_is_written(cli, tmp_path: Path) -> None:
    result = cli("run", "--set", "tracking.enabled=false", "--output", tmp_path / "r")
    assert result.code == 2 and "tracking.enabled is false" in result.err
    assert not (tmp_path / "r").exists()
