"""Ctrl-C for `kubealign run`: SIGINT (the terminal's, to the whole process group, or to `kubealign run`
alone) and SIGTERM stop the whole run within seconds.

Each task runs in a session of its own (kubealign.pipelines.capture), so the terminal's SIGINT reaches
`kubealign run` alone. Its handler stops what runs as a cluster stops a pod: SIGTERM to each task's process
group (a training stage saves a checkpoint and exits, kubealign.training.preemption), SIGKILL after GRACE_S;
no further task starts. When the stopped task returns, the run ends with `Interrupted`, which the CLI
reports in one line, exit 130. Tasks that finished are in kfp.local's cache (recorded with or without
--cache): `kubealign run --cache` reuses them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from kubealign.pipelines.capture import Capture, Interrupted

GRACE_S = 10.0  # from SIGTERM to SIGKILL: a tiny training step and its checkpoint fit, a person waits no longer
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stopping_tasks(tasks: Capture, grace: float = GRACE_S) -> Iterator[None]:
    """SIGINT/SIGTERM during the block: the tasks stopped (Capture.interrupt), Interrupted raised as the
    stopped task returns; on the way out, no task process left (SIGKILL after `grace`). Outside the main thread (where
    Python delivers no signal) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        # no exception from here: the thread reading the task's output reads on to its end, and the task's
        # return raises Interrupted (Capture.execute_single_task)
        tasks.interrupt(grace)

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
        if tasks.interrupted:  # after the last task had started: nothing stopped, still not a finished run
            raise Interrupted()
    except Interrupted:
        tasks.wait_stopped(grace)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interrupted_line(tasks: Capture) -> str:
    """The one line an interrupted run ends with."""
    stopped = ", ".join(tasks.stopped) if tasks.stopped else "no task was running, none"
    return f"kubealign run: interrupted; {stopped} stopped; rerun with --cache to reuse what finished"
