"""What `kubealign run` prints: the per-task lines (a pure function of task states), the terminal and
the plain display, the helpers that read a task's output, and the kfp.local seam that feeds them —
checked on a two-task pipeline of its own (the whole DAG's output is checked in test_kfp_local.py)."""

# No `from __future__ import annotations`: KFP reads the components' annotations as objects.
import inspect
import io
from pathlib import Path

import pytest
from kfp import dsl

from kubealign.pipelines.capture import capture
from kubealign.pipelines.progress import (
    CACHED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    Display,
    Lines,
    TaskState,
    last_error_line,
    progress_of,
    render,
    render_line,
)


def test_render_shows_each_state_in_one_line() -> None:
    states = [
        TaskState("data-split", DONE, started=10.0, ended=13.44),
        TaskState("sft", RUNNING, started=13.5, progress="sft 45% 62/138"),
        TaskState("reward", CACHED),
        TaskState("ppo", FAILED, started=20.0, ended=21.5, log=Path("/nowhere/logs/ppo.log")),
        TaskState("evaluate", PENDING),
    ]
    assert render(states, now=25.8) == [
        "data-split  done in 3.4 s",
        "sft         running   12.3 s  sft 45% 62/138",
        "reward      cached (kfp.local reused an earlier run's outputs)",
        "ppo         FAILED after 1.5 s; log: /nowhere/logs/ppo.log",
        "evaluate    pending",
    ]
    assert render([TaskState("promote", DONE, started=0.0, ended=250.0)], now=251.0) == ["promote     done in 250 s"]
    # printed once (not a terminal), a running line does not show a time that will not move
    assert render_line(states[1], now=25.8, live=False) == "sft         running"
    # cut to the terminal's width: a wrapped line would break redrawing in place
    assert render(states, now=25.8, width=20)[1] == "sft         running "


def test_progress_is_read_from_tqdm_lines_only() -> None:
    assert progress_of("sft:  45%|████▍     | 62/138 [00:11<00:14,  5.36step/s]") == "sft 45% 62/138"
    ppo = "ppo:  40%|████      | 12/30 [00:28<00:25,  1.44s/iter, kl=0.423, reward=0.600]"
    assert progress_of(ppo) == "ppo 40% 12/30 kl=0.423, reward=0.600"
    assert (
        progress_of("Loading weights: 100%|██████████| 36/36 [00:00<00:00, 7120.05it/s]")
        == "Loading weights 100% 36/36"
    )
    assert progress_of(" 50%|#####     | 5/10 [00:00<00:00, 10.0it/s]") == "50% 5/10"
    assert progress_of("[KFP Executor 2026-11-23 04:25:19,892 INFO]: Got executor_input:") is None
    assert progress_of("accuracy 100% on 10/10 prompts") is None


def test_the_last_error_line_of_a_log() -> None:
    traceback = [
        "Traceback (most recent call last):",
        '  File "/opt/app/kubealign/data/sources.py", line 161, in read_source',
        "    raise UserError(f'data.sources[{index}].path: no such file')",
        "kubealign.errors.UserError: data.sources[0].path: no such file or directory: x.jsonl",
        "",
    ]
    assert last_error_line(traceback) == "UserError: data.sources[0].path: no such file or directory: x.jsonl"
    assert last_error_line(["kubealign: error: sft.lr: must be > 0", "bye"]) == "sft.lr: must be > 0"
    assert last_error_line(["ValueError: first", "torch.OutOfMemoryError: CUDA out of memory."]) == (
        "OutOfMemoryError: CUDA out of memory."
    )
    assert last_error_line(["KeyboardInterrupt"]) == "KeyboardInterrupt"
    assert last_error_line(["Errors were found in 0 files", "all fine"]) is None
    # a rank's traceback under torch.distributed: every line prefixed with its rank
    ranked = ["[rank0]:     raise UserError(", "[rank0]: kubealign.errors.UserError: lora.r: no module", "done"]
    assert last_error_line(ranked) == "UserError: lora.r: no module"


def test_lines_split_at_newlines_and_carriage_returns_across_chunks() -> None:
    lines = Lines()
    assert lines.feed(b"one\ntwo\r") == ["one"]  # a trailing \r may be the start of \r\n
    assert lines.feed(b"\nbar 1%\rbar 2%") == ["two", "bar 1%"]
    assert lines.feed(b"\rbar 3%\n\xe2\x96") == ["bar 2%", "bar 3%"]
    assert lines.feed(b"\x88 done") == []
    assert lines.close() == ["\u2588 done"]


def test_plain_display_prints_one_line_per_state_change() -> None:
    out = io.StringIO()  # not a terminal
    with Display(out, ["data-split", "sft"]) as display:
        display.update("data-split", status=RUNNING)
        display.update("data-split", progress="Map 50% 1/2")  # progress alone prints nothing
        display.update("data-split", status=DONE)
        display.update("sft", status=CACHED)
        display.update("sft", status=CACHED)
    lines = out.getvalue().splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["data-split", "running"],
        ["data-split", "done"],
        ["sft", "cached"],
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_display_redraws_its_lines_in_place() -> None:
    out = FakeTerminal()
    with Display(out, ["a", "b", "c"]) as display:
        display.update("a", status=RUNNING, progress="a 10% 1/10")
        display.update("a", status=DONE)
    text = out.getvalue()
    assert text.startswith("\x1b[2Ka           pending\n")  # the first draw: every task pending
    assert "\x1b[3A\r" in text  # later draws go back up the three lines first
    last = text.rsplit("\x1b[3A\r", 1)[1]
    assert [line.removeprefix("\x1b[2K") for line in last.splitlines()] == [
        "a           done in 0.0 s",
        "b           pending",
        "c           pending",
    ]


def test_kfp_local_seams_are_where_capture_expects_them() -> None:
    """capture() replaces two kfp.local module functions; this fails first if kfp moves them."""
    from kfp.local import subprocess_task_handler
    from kfp.local.orchestrator import dag_orchestrator, enhanced_dag_orchestrator, task_executor

    run_local = inspect.signature(subprocess_task_handler.run_local_subprocess)
    assert list(run_local.parameters) == ["full_command", "env_vars"]
    assert "run_local_subprocess(" in inspect.getsource(subprocess_task_handler.SubprocessTaskHandler.run)
    assert "task_name" in inspect.signature(task_executor.execute_single_task).parameters
    for orchestrator in (dag_orchestrator, enhanced_dag_orchestrator):
        source = inspect.getsource(orchestrator)
        assert "task_executor.execute_single_task(" in source and "task_name=task_name" in source


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def chatty(n: int) -> int:
    import sys

    for i in range(n + 1):
        sys.stderr.write(f"\rwork: {100 * i // n:3d}%|#   | {i}/{n} [00:00<00:00, 9.9it/s]")
    sys.stderr.write("\n")
    print("chatty says hello")
    return n


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def broken(n: int) -> None:
    raise ValueError(f"broken on purpose after {n}")


@dsl.pipeline(name="two-tasks")
def two_tasks(n: int = 4) -> None:
    broken(n=chatty(n=n).output)


@pytest.mark.kfp
def test_capture_logs_each_task_and_reports_the_failed_one(tmp_path: Path) -> None:
    from kfp import local
    from kfp.local import subprocess_task_handler
    from kfp.local.orchestrator import task_executor

    originals = (task_executor.execute_single_task, subprocess_task_handler.run_local_subprocess)
    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=False
    )
    out = io.StringIO()
    with Display(out, ["chatty", "broken"]) as display, capture(tmp_path / "logs", display, echo=False) as tasks:
        two_tasks()
    assert (task_executor.execute_single_task, subprocess_task_handler.run_local_subprocess) == originals
    chatty_log = (tmp_path / "logs" / "chatty.log").read_text(encoding="utf-8")
    assert "chatty says hello" in chatty_log and "work: 100%|#   | 4/4" in chatty_log
    assert display.states["chatty"].status == DONE and display.states["chatty"].progress == "work 100% 4/4"
    failed = tasks.failed()
    assert failed is not None and failed.name == "broken" and failed.returncode != 0
    assert failed.log == tmp_path / "logs" / "broken.log"
    assert failed.error_line() == "ValueError: broken on purpose after 4"
    assert [line.split()[:2] for line in out.getvalue().splitlines()] == [
        ["chatty", "running"],
        ["chatty", "done"],
        ["broken", "running"],
        ["broken", "FAILED"],
    ]
