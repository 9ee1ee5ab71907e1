"""Tracking never costs a trained model (issue 12, cases 2 and 4): a real `mlflow server` on 127.0.0.1,
killed during `kubealign sft` or made to fail the run's last call, and a stage that fails for its own
reason while the server fails too. The stage warns in one line and exports; its result.json keeps every
metric; a real error stays the one-line error it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import NO_TRACKING, write_jsonl
from tests.support.faults import FaultProxy, MlflowServer, fail_when, free_port

pytestmark = pytest.mark.faults
LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("data") / "split"
    assert main(["data-split", "--set", NO_TRACKING, "--output", str(out)]) == 0
    return out


def sft(split_dir: Path, out: Path, uri: str, *sets: str) -> subprocess.Popen:
    """`kubealign sft` in its own process against `uri`, with MLflow's HTTP settings left to kubealign."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("MLFLOW_HTTP_")}
    env.update(TQDM_DISABLE="1", MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1")
    args = ["sft", "--data", split_dir, *(a for s in sets for a in ("--set", s)), "--output", out]
    cmd = [sys.executable, "-m", "kubealign.cli", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the stage was still running {timeout:.0f} s later; stderr ends:\n{err[-3000:]}")


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kubealign: warning:")]


def steps_of(result: dict, key: str) -> list[int]:
    return [entry["step"] for entry in result["tracked_metrics"] if key in entry]


def test_sft_exports_when_the_tracking_server_is_killed_mid_training(split_dir: Path, tmp_path: Path):
    server = MlflowServer(tmp_path / "mlflow").start()
    out = tmp_path / "sft"
    sets = ["sft.num_train_epochs=0.5", "sft.eval_every_steps=5", "sft.save_every_steps=4"]  # 18 steps
    proc = sft(split_dir, out, server.url, *sets)
    try:
        client = MlflowClient(server.url)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:  # the first steps have reached the server
            runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
            if runs and len(client.get_metric_history(runs[0].info.run_id, "train_loss")) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the stage ended before the server could be killed"
    finally:
        server.kill()
    killed = time.monotonic()
    _, err = finish(proc, timeout=400)
    after_kill_s = time.monotonic() - killed
    print(f"server killed; the stage ended {after_kill_s:.1f} s later")
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    down, stayed = warnings_in(err)  # one line when it went away, one at the end
    assert f"MLflow tracking at {server.url} is unreachable" in down
    assert "stayed unreachable: the run is incomplete" in stayed and "result.json holds its metrics" in stayed
    assert after_kill_s < 150, after_kill_s  # the rest of training + a short last try, not ~4 min a call

    from transformers import AutoModelForCausalLM

    result = json.loads((out / "result.json").read_text())
    assert result["metrics"]["steps"] == 18
    assert steps_of(result, "train_loss") == list(range(1, 19))  # every metric of the run, in the output
    assert steps_of(result, "eval_perplexity") == [0, 5, 10, 15, 18]
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")  # what the server got before dying
    (run,) = [r for e in store.search_experiments() for r in store.search_runs([e.experiment_id])]
    assert 2 <= len(store.get_metric_history(run.info.run_id, "train_loss")) < 18
    assert run.info.status == "RUNNING"


def test_sft_exports_when_ending_the_run_fails(split_dir: Path, tmp_path: Path):
    server = MlflowServer(tmp_path / "mlflow").start()
    proxy = FaultProxy(server.url).start()
    refused_at: list[float] = []

    def end_of_run(method: str, path: str, body: bytes) -> int | None:  # set_terminated: the very last call
        if method == "POST" and path.endswith("/runs/update"):
            refused_at.append(time.monotonic())
            return 503
        return None

    proxy.rules.append(end_of_run)
    out = tmp_path / "sft"
    try:
        _, err = finish(sft(split_dir, out, proxy.url, "sft.num_train_epochs=0.1"), timeout=400)
        ending_s = time.monotonic() - refused_at[0]
        print(f"ending the run failed; the stage exited {ending_s:.1f} s after the first refusal")
        client = MlflowClient(server.url)
        (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
        logged = client.get_metric_history(run.info.run_id, "train_loss")
    finally:
        proxy.stop()
        server.kill()
    assert "Traceback" not in err
    (line,) = warnings_in(err)
    assert "could not mark the run FINISHED" in line, line
    result = json.loads((out / "result.json").read_text())
    assert [m.step for m in logged] == steps_of(result, "train_loss") == list(range(1, result["metrics"]["steps"] + 1))
    assert run.info.status == "RUNNING"
    assert len(refused_at) == 3  # MLflow's retries, made short for this stage (2), then one line and exit 0
    assert ending_s < 30, ending_s  # MLflow's defaults: 7 retries of a 503 over ~4 minutes, then a traceback


def test_a_stage_error_stays_one_line_when_ending_the_run_fails(cli, split_dir: Path, tmp_path: Path, monkeypatch):
    server = MlflowServer(tmp_path / "mlflow").start()
    proxy = FaultProxy(server.url).start()
    proxy.rules.append(fail_when("POST", "/runs/update", 503))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # only to keep the run short
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p"}])
    bad.write_text("{nope\n")
    try:
        cases = [  # a required run (data-split), then a best-effort one (sft)
            (["data-split", "--set", f"data.sources=[{{path: {bad}}}]"], "bad.jsonl:1"),
            (["sft", "--data", split_dir, "--set", "sft.micro_batch_size=5000"], "sft.micro_batch_size: 5000"),
        ]
        for args, real_error in cases:
            result = cli(*args, "--output", tmp_path / "out")
            assert result.code == 2, result.err
            assert "Traceback" not in result.err
            lines = [line for line in result.err.splitlines() if line.startswith("kubealign")]
            assert len(lines) == 2, lines
            assert "could not mark the run FAILED" in lines[0]
            assert lines[1].startswith("kubealign: error: ") and real_error in lines[1]
    finally:
        proxy.stop()
        server.kill()


def test_a_dead_server_at_the_start_is_one_line_in_seconds(cli, split_dir: Path, tmp_path: Path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("MLFLOW_HTTP_")]:
        monkeypatch.delenv(key)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    result = cli("sft", "--data", split_dir, "--output", tmp_path / "sft")
    assert time.monotonic() - started < 30  # MLflow's own defaults retry a refused connection for ~4 minutes
    assert result.code == 2
    (line,) = result.err.strip().splitlines()
    assert line.startswith(f"kubealign: error: MLflow tracking at {uri}: ")
    assert not (tmp_path / "sft").exists()
    assert not [k for k in os.environ if k.startswith("MLFLOW_HTTP_")]  # set for the stage only
