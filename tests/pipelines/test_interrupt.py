"""Ctrl-C stops `kubealign run` within seconds, every task process with it, in one line and exit 130; what
finished (in a run without --cache) is reused by the next `kubealign run --cache`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.kfp, pytest.mark.integration]

# enough training steps (about 100 a stage) that the signal, sent once the first step shows, arrives before the
# training loop ends on a fast machine: one epoch (8 steps, half a second) was over before it came
TINY = [
    "sft.num_train_epochs=12",
    "reward.num_train_epochs=12",
    "ppo.num_iterations=1",
    "evaluate.max_prompts=4",
    "promote.min_win_rate=0",
    "promote.min_reward_gain=-100",
    "promote.min_win_rate_lower_bound=null",
]
STAGES = ["data-split", "sft", "reward", "ppo", "evaluate", "promote"]


def command(out: Path, *extra: str) -> list[str]:
    sets = [arg for item in TINY for arg in ("--set", item)]
    return [sys.executable, "-m", "kubealign.cli", "run", *sets, "--output", str(out), *extra]


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (is_running compares start times: a reused pid is not one of them)."""
    found = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def trains(log: Path, task: str) -> bool:
    """Whether the task's log shows its training's progress bar ("sft:  12%|...", not a loading bar)."""
    text = log.read_text(encoding="utf-8") if log.is_file() else ""
    return any(line.startswith(task) and "%|" in line for line in re.split(r"[\r\n]", text))


def interrupt_training(tmp_path: Path, env: dict[str, str], send: Callable[[int], None]) -> str:
    """Start `kubealign run` into tmp_path/a, `send` (its pid) a signal once a training task trains, and check
    that the run stopped as Ctrl-C must stop it. Returns the training task's name."""
    # a process group of its own, as a shell gives a command: the terminal's Ctrl-C goes to the whole group
    run = subprocess.Popen(
        command(tmp_path / "a"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert run.stdout is not None
        seen = []
        for line in run.stdout:  # one line per state change (not a terminal)
            seen.append(line)
            if line.split()[1:2] == ["running"] and line.split()[0] != "data-split":
                break
        assert seen and seen[-1].split()[:2] == [seen[-1].split()[0], "running"], "".join(seen)
        training = seen[-1].split()[0]  # sft or reward: the first after data-split
        log = tmp_path / "a" / "logs" / f"{training}.log"
        deadline = time.monotonic() + 90
        while not trains(log, training) and time.monotonic() < deadline:
            time.sleep(0.1)
        tasks = psutil.Process(run.pid).children(recursive=True)
        assert tasks, "no task process to stop"
        send(run.pid)
        started = time.monotonic()
        rest, err = run.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err
    assert took < 20
    assert err.splitlines()[-1].startswith("kubealign run: interrupted; ")
    assert f"; {training} stopped; rerun with --cache" in err.splitlines()[-1]
    assert f"{training:<12}stopped (interrupted)" in rest
    assert "Traceback" not in err
    assert not alive(tasks), alive(tasks)
    # SIGTERM first, as on preemption: the stage stopped at a step boundary with a checkpoint, logged
    assert "stopped by SIGTERM at " in log.read_text(encoding="utf-8")
    assert "promote" not in rest  # nothing started after the interrupt
    return training


def test_ctrl_c_stops_every_task_then_cache_reuses_what_finished(tmp_path: Path) -> None:
    # progress bars on (the test session disables them): the test waits for the first training step
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env["KUBEALIGN_CACHE_DIR"] = str(tmp_path / "cache")
    training = interrupt_training(tmp_path, env, lambda pid: os.killpg(pid, signal.SIGINT))

    again = subprocess.run(command(tmp_path / "b", "--cache"), env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout + again.stderr
    # data-split finished in the interrupted run, which ran without --cache: reused
    assert "data-split  cached" in again.stdout
    assert f"{training:<12}done" in again.stdout
    index = json.loads((tmp_path / "b" / "run.json").read_text(encoding="utf-8"))
    assert index["succeeded"] and set(index["stages"]) == set(STAGES)


def test_sigterm_to_kubealign_run_alone_stops_it_the_same_way(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env["KUBEALIGN_CACHE_DIR"] = str(tmp_path / "cache")
    interrupt_training(tmp_path, env, lambda pid: os.kill(pid, signal.SIGTERM))
