"""Issue 12 with real parts: DeepSpeed op builds SIGKILLed mid-compile, live and dead lock holders, stage
starts racing each other, and tiny real training runs driven to a non-finite loss."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import NO_TRACKING
from tests.stages.test_training import launcher, split_dir  # noqa: F401  (module-scoped fixture)

pytestmark = pytest.mark.faults

OP = "deepspeed_shm_comm"  # what DeepSpeed's CPU backend builds in init_distributed, in every process
STALE = "removed the stale build lock"
WAIT_ENV = "KUBEALIGN_OP_LOCK_WAIT_S"
BOUND_S = 300  # a stage start that builds the op: 20-50 s of compiling on 2 busy cores, plus imports
HOLD = """
import sys, time
from torch.utils.file_baton import FileBaton  # what torch.utils.cpp_extension builds under
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""
BUILD = 'from deepspeed.accelerator import get_accelerator\nget_accelerator().create_op_builder("ShareMemCommBuilder").load()'
INIT = "from kubealign.training import distributed\nprint(distributed.init())"


def environment(extensions: Path | None = None, **extra: str) -> dict[str, str]:
    launch = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}  # left by in-process stages
    env = {k: v for k, v in os.environ.items() if k not in launch}
    # the CPU op and CPU training, also on a machine with a GPU
    env.update(TQDM_DISABLE="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", **extra)
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    return env


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A process in its own group, so that it and its compiler children die together."""
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """Wait at most `timeout` s; a process still running then is killed and the test fails (a hang)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s (hung on the lock?): {err[-1500:]}")
    return proc.returncode, out, err


def kubealign(*args: object, env: dict[str, str], timeout: float = BOUND_S) -> tuple[int, str, str]:
    return finish(start([sys.executable, "-m", "kubealign.cli", *map(str, args)], env), timeout)


def hold(lock: Path) -> subprocess.Popen:
    """A live process holding `lock` the way torch's builder does (a FileBaton, fd open)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = start([sys.executable, "-c", HOLD, str(lock)], environment())
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def stale_lock(extensions: Path) -> Path:
    """A lock whose owner was SIGKILLed while holding it."""
    lock = extensions / OP / "lock"
    kill(hold(lock))
    assert lock.exists()
    return lock


@pytest.fixture(scope="module")
def extensions(tmp_path_factory) -> Path:
    """A private TORCH_EXTENSIONS_DIR (not the user's cache, which other runs share), empty: the system test
    builds the op in it from nothing."""
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="module")
def built_extensions(tmp_path_factory) -> Path:
    """A private TORCH_EXTENSIONS_DIR holding the op already built: a copy (mtimes kept, so ninja finds it
    up to date) of the build every DeepSpeed start in this environment uses, made first if it is not there. What
    the lock tests prove does not need a compile of their own (a minute of both cores; `make test-system`
    compiles from nothing)."""
    from kubealign.training import oplocks

    shared = oplocks.extensions_root()  # this environment's (TORCH_EXTENSIONS_DIR, set by tests/conftest.py)
    code, _, err = finish(start([sys.executable, "-c", BUILD], environment(shared)), BOUND_S)
    assert code == 0 and list((shared / OP).glob(f"{OP}*.so")), err[-2000:]
    private = tmp_path_factory.mktemp("torch_extensions")
    shutil.copytree(shared / OP, private / OP, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    return private


@pytest.mark.system  # compiles a DeepSpeed C++ op twice: a slow build, in `make test-system`
def test_stage_starts_racing_after_a_build_killed_mid_compile_clear_its_lock_once(extensions: Path):
    build_dir, lock = extensions / OP, extensions / OP / "lock"
    builder = start([sys.executable, "-c", BUILD], environment(extensions))
    try:
        deadline = time.monotonic() + 120
        while not ((build_dir / "build.ninja").exists() and lock.exists()):  # written under the lock
            assert builder.poll() is None and time.monotonic() < deadline, builder.stderr.read()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)  # the compiler is running
    finally:
        kill(builder)  # SIGKILL, the whole group: python, ninja, c++
    assert builder.returncode == -signal.SIGKILL and lock.exists()
    assert not list(build_dir.glob("*.so"))  # killed before it linked: the next start builds it

    # Two stage starts at once (two ranks, or two tasks on one node): both must get through; one of them
    # removes the dead builder's lock, the other waits for (never removes) the lock of the live build.
    env = environment(extensions, OMP_NUM_THREADS="1")
    racers = [start([sys.executable, "-c", INIT], env) for _ in range(2)]
    started = time.monotonic()
    try:
        results = [finish(proc, BOUND_S) for proc in racers]
    finally:
        for proc in racers:
            kill(proc)
    elapsed = time.monotonic() - started
    for code, out, err in results:
        assert code == 0 and "(0, 1)" in out, err[-2000:]
    warnings = [line for _, _, err in results for line in err.splitlines() if STALE in line]
    assert len(warnings) == 1 and str(lock) in warnings[0], warnings
    assert not lock.exists() and list(build_dir.glob(f"{OP}*.so"))
    print(f"two racing starts after a killed build: {elapsed:.0f} s")


def test_a_stage_gets_through_a_lock_whose_owner_was_sigkilled(built_extensions: Path, split_dir: Path, tmp_path):  # noqa: F811
    extensions = built_extensions
    lock = stale_lock(extensions)
    started = time.monotonic()
    code, _, err = kubealign(
        "sft",
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        "sft.num_train_epochs=0.05",
        "--output",
        tmp_path / "sft",
        env=environment(extensions),
    )
    assert code == 0, err[-2000:]
    assert any(STALE in line and str(lock) in line for line in err.splitlines()), err[-2000:]
    assert not lock.exists() and (tmp_path / "sft" / "model.safetensors").is_file()
    print(f"sft through a stale lock: {time.monotonic() - started:.0f} s")


def test_a_lock_held_by_a_live_process_is_waited_for_bounded_and_never_removed(
    extensions: Path,
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
):
    lock = extensions / OP / "lock"
    holder = hold(lock)
    try:
        started = time.monotonic()
        code, _, err = kubealign(
            "sft",
            "--data",
            split_dir,
            "--set",
            NO_TRACKING,
            "--output",
            tmp_path / "sft",
            env=environment(extensions, **{WAIT_ENV: "4"}),
            timeout=120,
        )
        elapsed = time.monotonic() - started
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("kubealign: error: the DeepSpeed op deepspeed_shm_comm"), err[-2000:]
        assert f"still locked by process {holder.pid} " in last and str(lock) in last and WAIT_ENV in last
        assert f"kubealign: waiting for process {holder.pid}" in err  # said while it waited, before giving up
        assert "Traceback" not in err and lock.exists() and holder.poll() is None  # not removed, not touched
        assert not (tmp_path / "sft").exists() and elapsed < 90

        # The owner dies while a stage start waits for it: its lock is removed then, no hang.
        from kubealign.training import oplocks

        threading.Timer(3.0, kill, [holder]).start()
        with caplog.at_level("WARNING", logger=oplocks.__name__):
            oplocks.wait_for([OP], extensions, timeout=60)
        assert not lock.exists() and holder.returncode == -signal.SIGKILL
        assert any(STALE in r.getMessage() and str(lock) in r.getMessage() for r in caplog.records)
    finally:
        kill(holder)
        lock.unlink(missing_ok=True)


def test_sft_stops_at_the_first_non_finite_loss_and_keeps_the_last_checkpoint(split_dir: Path, tmp_path: Path):  # noqa: F811
    out, checkpoints = tmp_path / "sft", tmp_path / "sft.checkpoints"
    # inf is refused by the config now; 1e30 is finite, and the warmup makes step 3 the first nan loss
    common = [
        "sft",
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        "sft.learning_rate=1e30",
        "--set",
        "sft.save_every_steps=2",
        "--output",
        out,
    ]
    code, _, err = kubealign(*common, env=environment())
    lines = err.strip().splitlines()
    pattern = (
        r"^kubealign: error: sft: loss is nan at step 3 \(learning rate [0-9.e+]+; too high\?\); stopped before the "
        rf"step was applied, no model was written, the last checkpoint \({re.escape(str(checkpoints))}, step2\) is kept$"
    )
    assert code == 2 and re.match(pattern, lines[-1]) and "Traceback" not in err, err[-2000:]
    assert not out.exists() and (checkpoints / "latest").read_text().strip() == "step2"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step2"]  # step 3 was never saved
    # The kept checkpoint is whole: its weights load strictly into the model, at the step it names.
    import torch
    from transformers import AutoModelForCausalLM

    from kubealign.models import loading

    state = torch.load(checkpoints / "step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["step"] == 2 and state["global_steps"] == 2
    model = AutoModelForCausalLM.from_pretrained(loading.resolve("tiny-opt"))
    model.load_state_dict(state["module"], strict=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sft_whose_last_step_diverges_exports_nothing(split_dir: Path, tmp_path: Path):  # noqa: F811
    out = tmp_path / "sft"
    code, _, err = kubealign(
        "sft",
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        "sft.learning_rate=1e30",
        "--set",
        "sft.num_train_epochs=0.05",
        "--output",
        out,
        env=environment(),
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "sft: the evaluation after the last step (2) gives perplexity nan, loss nan" in last, err
    assert not out.exists() and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_critic(tmp_path_factory) -> Path:
    """An untrained reward model / critic dir over the tiny OPT (no training needed to diverge)."""
    from transformers import AutoModelForSequenceClassification

    from kubealign.models import loading

    actor = loading.resolve("tiny-opt")
    tokenizer = loading.load_tokenizer(actor)
    out = tmp_path_factory.mktemp("critic") / "critic"
    model = AutoModelForSequenceClassification.from_pretrained(actor, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_ppo_stops_at_the_first_non_finite_loss_and_keeps_the_last_checkpoint(
    split_dir: Path,  # noqa: F811
    tiny_critic: Path,
    tmp_path: Path,
):
    from kubealign.models import loading

    out = tmp_path / "ppo"
    code, _, err = kubealign(
        "ppo",
        "--prompts",
        split_dir,
        "--actor",
        loading.resolve("tiny-opt"),
        "--critic",
        tiny_critic,
        "--set",
        NO_TRACKING,
        "--set",
        "ppo.actor_learning_rate=1e30",
        "--set",
        "ppo.num_iterations=4",
        "--set",
        "ppo.save_every_iterations=1",
        "--output",
        out,
        env=environment(),
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    # The diverged actor's log-probs are what is not finite in iteration 2's experience, and the learning rate
    # is named as the suspect (a frozen model's nan is not: tests/stages/test_ppo.py).
    actor = r"the actor's log-prob is not finite \(nan\) for (\d+) of \1 tokens"
    assert re.match(rf"^kubealign: error: ppo: {actor} at iteration 2 \(actor learning rate 1e\+30", last), last
    assert last.endswith(f"the last checkpoint ({tmp_path / 'ppo.checkpoints'}, iter1) is kept"), last
    assert not out.exists()
    assert (tmp_path / "ppo.checkpoints" / "latest").read_text().strip() == "iter1"  # one latest for every part
    assert not (tmp_path / "ppo.checkpoints" / "actor" / "latest").exists()


def test_two_ranks_stop_together_at_a_non_finite_loss(split_dir: Path, tmp_path: Path):  # noqa: F811
    args = [
        "sft",
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        "sft.learning_rate=1e30",
        "--output",
        tmp_path / "sft",
    ]
    proc = start([*launcher("torchrun"), *args], environment(OMP_NUM_THREADS="1"))
    code, _, err = finish(proc, BOUND_S)  # a rank left behind in a collective would hang here
    assert code != 0
    steps = re.findall(r"kubealign: error: sft: loss is (?:nan|inf|nan or inf on a rank) at step (\d+) ", err)
    assert len(steps) == 2 and steps[0] == steps[1], err[-3000:]  # every rank, at the same step
    assert not (tmp_path / "sft").exists()
