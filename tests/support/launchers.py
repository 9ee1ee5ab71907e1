"""Launchers run from tests with a bound in time and nothing left behind: torchrun starts its workers in sessions
of their own, so killing torchrun alone (what subprocess.run's timeout does) would orphan ranks blocked in a
collective. On timeout: SIGTERM to torchrun (it passes it on to its workers and waits for them), then SIGKILL to
every process still in the tree."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def children(pid: int) -> list[int]:
    """Every descendant of PID (from /proc), deepest last."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                kids = (task / "children").read_text().split()
                found += map(int, kids)
                frontier += map(int, kids)
    return found


def stop_tree(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to PROC, up to GRACE_S for it to end, then SIGKILL to whatever of its tree is left."""
    tree = children(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    for pid in [proc.pid, *tree, *children(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class TimedOut(AssertionError):
    """A launch ran past its bound (its processes were stopped)."""


def run(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output, text) bounded by TIMEOUT, the whole process tree stopped after."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree(proc)
        raise TimedOut(f"{' '.join(command[:6])} ... still running after {time.monotonic() - started:.0f} s") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)
