"""The reward-function worker inside limits (issue 37): the user's code sees none of the task's credentials,
writes relative paths into a private directory, cannot take the trainer's memory, leaves no process behind
a timeout, and cannot flood the task's log. Real worker processes, real limits."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kubealign.config.schema import RewardsConfig
from kubealign.errors import UserError
from kubealign.usercode import definitions
from kubealign.usercode.runner import OUTPUT_LIMIT, FunctionRunner, worker_env

pytestmark = pytest.mark.unit

FUNCTIONS = """
import os, subprocess, time

def secret_length(prompts, completions, **columns):
    return [float(len(os.environ.get("AWS_SECRET_ACCESS_KEY", "")))] * len(completions)

def writes_relative(prompts, completions, **columns):
    with open("result.json", "w") as f:
        f.write("{}")
    return [float(os.getcwd() == os.environ["HOME"])] * len(completions)

def greedy(prompts, completions, **columns):
    hog = bytearray(1024 * 2**20)  # 1 GiB
    return [float(len(hog))] * len(completions)

def spawns_and_hangs(prompts, completions, **columns):
    child = subprocess.Popen(["sleep", "600"])
    detached = subprocess.Popen(["sleep", "600"], start_new_session=True)  # out of the worker's group
    print("CHILD-PIDS", child.pid, detached.pid, flush=True)
    time.sleep(600)

def children_hold(prompts, completions, **columns):
    # four children of 100 MiB each: under the limit one by one, past it together
    import sys
    hold = "b = b'x' * (100 * 2**20); print('ready', flush=True); import time; time.sleep(60)"
    kids = [subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE) for _ in range(4)]
    for kid in kids:
        kid.stdout.readline()
    time.sleep(2)
    return [1.0] * len(completions)

def many_children(prompts, completions, **columns):
    kids = [subprocess.Popen(["sleep", "30"]) for _ in range(8)]
    time.sleep(2)
    return [float(len(kids))] * len(completions)

def loud(prompts, completions, **columns):
    print("x" * 300_000)
    print("THE END")
    return [1.0] * len(completions)
"""


def runner(
    directory: Path, name: str, timeout_s: float = 20.0, memory_mb: int = 4096, env: list[str] | None = None, **more
):
    (directory / "fns.py").write_text(FUNCTIONS, encoding="utf-8")
    rewards = RewardsConfig(functions=[{"path": f"fns.py:{name}"}], timeout_s=timeout_s)
    return FunctionRunner(definitions.resolve(rewards, str(directory)), timeout_s, memory_mb, env, **more)


def call(r: FunctionRunner) -> list:
    return r.call(r.specs[0], ["p"], ["c"], {}, ["d.jsonl:1"])


def test_the_worker_sees_no_credential_unless_the_config_passes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-key")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    with runner(tmp_path, "secret_length") as r:
        assert call(r) == [0.0]
    with runner(tmp_path, "secret_length", env=["AWS_SECRET_ACCESS_KEY"]) as r:
        assert call(r) == [10.0]
    env = worker_env(
        {
            "PATH": "/bin",
            "LC_ALL": "C",
            "AWS_SECRET_ACCESS_KEY": "k",
            "MLFLOW_TRACKING_PASSWORD": "p",
            "PYTHONPATH": "/lib",
        },
        [],
        tmp_path / "home",
        "/srv/stage",
    )
    assert "AWS_SECRET_ACCESS_KEY" not in env and "MLFLOW_TRACKING_PASSWORD" not in env
    assert (env["PATH"], env["LC_ALL"], env["HOME"], env["TMPDIR"]) == ("/bin", "C", *[str(tmp_path / "home")] * 2)
    assert env["PYTHONPATH"] == os.pathsep.join(["/lib", "/srv/stage"])  # module:NAME still importable


def test_a_relative_write_lands_in_the_private_directory_which_goes_at_the_end(tmp_path, monkeypatch):
    stage = tmp_path / "stage"
    stage.mkdir()
    monkeypatch.chdir(stage)  # where the stage runs, its outputs beside it
    with runner(tmp_path, "writes_relative") as r:
        assert call(r) == [1.0]  # its working directory is its HOME: the private directory
        home = r.home
        assert (home / "result.json").is_file()
    assert not (stage / "result.json").exists() and not home.exists()


def test_past_its_memory_limit_a_function_fails_in_one_line_and_the_caller_lives(tmp_path):
    with runner(tmp_path, "greedy", memory_mb=512) as r, pytest.raises(UserError) as err:
        call(r)
    assert str(err.value) == (
        "reward function greedy (rewards.functions[0].path): ran out of its memory, rewards.memory_limit_mb 512 "
        "(a batch of 1 rows starting at d.jsonl:1)"
    )
    with runner(tmp_path, "greedy", memory_mb=2048) as r:  # room for it: the same function works
        assert call(r) == [float(2**30)]


def test_the_memory_limit_holds_for_the_worker_and_its_children_together(tmp_path):
    """Four children of 100 MiB under a limit of 256 MiB, each under it alone (before: 1,880 MiB held by six
    children under a 512 MiB limit); the line names the setting."""
    with runner(tmp_path, "children_hold", memory_mb=256) as r, pytest.raises(UserError) as err:
        call(r)
    assert str(err.value).startswith("reward function children_hold (rewards.functions[0].path): its processes held ")
    assert ", past rewards.memory_limit_mb 256 (a batch of 1 rows starting at d.jsonl:1); stopped" in str(err.value)
    assert r.process is None


def test_the_number_of_processes_is_bounded(tmp_path):
    with runner(tmp_path, "many_children", max_processes=4) as r, pytest.raises(UserError) as err:
        call(r)
    assert str(err.value).startswith("reward function many_children (rewards.functions[0].path): it ran ")
    assert "processes besides the worker, past rewards.max_processes 4" in str(err.value)
    with runner(tmp_path, "many_children", max_processes=12) as r:  # room for them
        assert call(r) == [8.0]


def test_a_timeout_ends_every_process_the_function_started(tmp_path, capfd):
    """Its child, and one it detached into a session of its own (which the process group's kill missed)."""
    r = runner(tmp_path, "spawns_and_hangs", timeout_s=3.0)
    with r, pytest.raises(UserError, match="no answer within rewards.timeout_s 3 s"):
        call(r)
    line = next(line for line in capfd.readouterr().err.splitlines() if line.startswith("CHILD-PIDS"))
    for child in map(int, line.split()[1:]):
        for _ in range(50):  # killed; reaped by init once its parent is gone
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break  # a zombie: dead, waiting for init to reap it
            time.sleep(0.1)
        else:
            pytest.fail(f"the function's child {child} outlived the timeout")


def test_what_a_function_prints_reaches_the_log_bounded_and_the_cut_is_said_once(tmp_path, capfd):
    with runner(tmp_path, "loud") as r:
        assert call(r) == [1.0] and call(r) == [1.0]
    err = capfd.readouterr().err
    assert err.count("reward functions printed") == 1  # said once, for two calls
    assert err.count("THE END") == 2  # the last part of each call kept
    assert len(err) < 2 * OUTPUT_LIMIT + 1000 < 2 * 300_000


def test_the_trainer_is_not_dumpable_while_a_worker_runs(tmp_path):
    """A non-dumpable process's /proc entries are root's: a worker of the same non-root uid cannot open its
    environ or cwd even without Landlock. The setting is the trainer's own again once the worker is gone."""
    from kubealign.usercode import sandbox

    get_dumpable = 3  # PR_GET_DUMPABLE
    assert sandbox._prctl(get_dumpable, 0) == 1
    with runner(tmp_path, "secret_length") as r:
        assert sandbox._prctl(get_dumpable, 0) == 0
        assert call(r) == [0.0]
    assert sandbox._prctl(get_dumpable, 0) == 1
