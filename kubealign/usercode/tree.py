"""The worker's process tree bounded as a whole: its memory and its number of processes, measured by the trainer.

The worker's own limits are per process (RLIMIT_AS, kubealign.usercode.worker.limit_self): six children of a
function each stayed under a 512 MiB limit and held 1,880 MiB together, and nothing bounded their number. A
`Watch` (a thread of the trainer's, from the worker's start to its end) reads the tree every PERIOD_S seconds
from /proc — the worker and everything under it, detached processes included (the worker is their subreaper) —
and ends the whole tree when its processes hold more than `memory_mb` together (their proportional set size,
so pages shared after a fork count once) or when more than `max_processes` run besides the worker. Its verdict
is the line the runner raises, naming the setting. It needs nothing from the kernel but /proc, so it holds
for any uid, in a pod as here; between two readings a process may go past the limit by what it allocates in
PERIOD_S, never past its own RLIMIT_AS. The kernel's own bound on the count, RLIMIT_NPROC, is set by the worker
(`nproc_limit`): it counts every task of the uid (threads included) and does not apply to uid 0.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from kubealign.usercode import sandbox

PERIOD_S = 0.25


def held_kib(pid: int) -> int:
    """What process `pid` holds, KiB: its proportional set size (smaps_rollup), else its resident set; 0 if gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    with contextlib.suppress(OSError, ValueError, IndexError):
        import os

        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    return 0


def measure(pid: int, memory_mb: int, max_processes: int) -> str | None:
    """None while the tree under `pid` keeps to both limits; else what it went past, in words."""
    found = sandbox.descendants(pid)
    if len(found) > max_processes:
        return f"it ran {len(found)} processes besides the worker, past rewards.max_processes {max_processes}"
    held = sum(held_kib(p) for p in [pid, *found]) // 1024
    if held > memory_mb:
        return f"its processes held {held} MiB together, past rewards.memory_limit_mb {memory_mb}"
    return None


class Watch:
    """Measures the tree under `pid` every PERIOD_S seconds until `stop`; past a limit it ends the tree and keeps
    what happened in `verdict`."""

    def __init__(self, pid: int, memory_mb: int, max_processes: int) -> None:
        self.pid, self.memory_mb, self.max_processes = pid, memory_mb, max_processes
        self.verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubealign-watch-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            if self.check() is not None:
                return

    def check(self) -> str | None:
        """Measure now (the runner does at every reply too: a burst of processes the call leaves behind is caught
        before the call returns); past a limit, end the tree and say why."""
        try:
            verdict = measure(self.pid, self.memory_mb, self.max_processes)
        except OSError:  # /proc unreadable: nothing to measure with
            return None
        if verdict is not None and not self._stop.is_set():
            self.verdict = verdict
            with contextlib.suppress(OSError):
                sandbox.end_tree(self.pid)
        return self.verdict

    def stop(self) -> None:
        """Measure no more (before the worker is reaped: its pid must not be taken for another's)."""
        self._stop.set()
        self._thread.join()


def uid_tasks(uid: int) -> int:
    """Tasks (threads) of real uid `uid` now: what the kernel's RLIMIT_NPROC counts."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
    return count


def nproc_limit(max_processes: int) -> str:
    """RLIMIT_NPROC of this process (the worker, before user code): the tasks its uid runs now plus max_processes
    and the worker's own few, in a line. The kernel refuses a fork or a thread past it, faster than any Watch —
    but counts the uid's other processes too (those started meanwhile take from it) and exempts uid 0."""
    import os
    import resource

    limit = uid_tasks(os.getuid()) + max_processes + 8
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    return f"RLIMIT_NPROC {limit}" if os.getuid() else "no RLIMIT_NPROC (uid 0 is exempt)"
