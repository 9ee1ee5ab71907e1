"""Preemption: a SIGTERM (what the kubelet sends a pod it evicts, drains or preempts, SIGKILL following after
the grace period, 30 s by default) or a SIGINT (Ctrl-C) asks a training stage to stop; it does so at the next
optimizer-step (PPO: iteration) boundary, with a checkpoint, instead of dying mid-step.

The handler only sets a flag. `StopRequest.agreed` reads it at a boundary on every rank through one
all_reduce, like the finite-loss check: ranks that got the signal at slightly different moments, or not
at all, stop at the same step, and none waits forever in a collective the others left. The stage then saves
(unless it just did), flushes its metrics and raises `Stopped`: the CLI prints one line and exits 128 + the
signal (143 for SIGTERM, 130 for SIGINT), the MLflow run ends KILLED. A second signal of the same kind
restores the previous handler's behaviour (Ctrl-C twice interrupts at once).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from kubealign.errors import Stopped
from kubealign.training import distributed

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager: installs the handlers (main thread only: Python delivers signals there) and puts
    the previous ones back on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum in self.received:  # the second one: as if this handler were not there
            signal.signal(signum, self.previous[signum])
            signal.raise_signal(signum)
            return
        self.received.append(signum)

    def agreed(self) -> int:
        """The signal every rank stops for (0: none): SIGTERM when any rank got one, else SIGINT when any
        rank got that. One all_reduce; call it on every rank at the same boundaries."""
        flags = distributed.all_reduce_sum(
            [float(signal.SIGTERM in self.received), float(signal.SIGINT in self.received)]
        )
        if flags[0]:
            return int(signal.SIGTERM)
        return int(signal.SIGINT) if flags[1] else 0


def stopped(stage: str, signum: int, where: str, checkpoint: str) -> Stopped:
    """The one line a stage stops with."""
    name = signal.Signals(signum).name
    return Stopped(
        f"{stage}: stopped by {name} at {where}; checkpoint {checkpoint} kept: run the same command with "
        "--resume to continue from it",
        signum,
    )


@contextlib.contextmanager
def raising(what: str) -> Iterator[None]:
    """While code only waits (the ppo task following its TrainJob): a SIGTERM or SIGINT raises Stopped at once,
    so that the `finally` blocks run (the TrainJob deleted, its staging removed) before the pod goes."""

    def handle(signum: int, frame: Any) -> None:
        raise Stopped(f"{what}: stopped by {signal.Signals(signum).name}", signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
