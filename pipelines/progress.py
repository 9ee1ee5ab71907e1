"""What `kubealign run` shows while the pipeline runs: one line per task.

A task is pending, running (with the last progress it printed: a tqdm bar's description, percentage,
count and postfix), done in N s, cached (kfp.local reused an earlier run's outputs) or failed (with
the path of its log). `render` is a pure function of the task states; `Display` puts its lines on a
terminal, redrawn in place, or, when stdout is not a terminal (CI, a pipe), prints one line per
state change and nothing else.

The helpers that read a task's output are here too: `Lines` splits a byte stream into lines at
"\\n", "\\r\\n" and a bare "\\r" (tqdm redraws its bar with "\\r"), `progress_of` finds a tqdm bar in
a line, and `last_error_line` picks the line a failed task's log ends on.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

PENDING, RUNNING, DONE, CACHED, FAILED = "pending", "running", "done", "cached", "failed"
SKIPPED = "skipped"  # never ran: a task it needs failed
STOPPED = "stopped"  # running when the run was interrupted (Ctrl-C)
NAME_WIDTH = 12

# tqdm's default format: "{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}, {rate}{postfix}]"
_TQDM = re.compile(
    r"(?:(?P<desc>[^|\r\n]*?):\s*)?(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<count>\d+/\d+)(?:\s*\[(?P<info>[^]]*)\])?"
)
# "ValueError: ...", "kubealign.errors.UserError: ...", "torch.OutOfMemoryError: ..." (a traceback's last line)
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<line>\w*(?:Error|Exception|Interrupt|Exit)(?::.*)?)$")
_CLI_ERROR = re.compile(r"^kubealign: error: (?P<line>.+)$")
# torch.distributed prefixes each line of a rank's traceback with "[rank0]: "
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


@dataclass
class TaskState:
    """One task of the run as the display shows it. Times are time.monotonic() seconds."""

    name: str
    status: str = PENDING
    started: float | None = None
    ended: float | None = None
    progress: str = ""
    log: Path | None = None


def progress_of(line: str) -> str | None:
    """'ppo 40% 12/30 kl=0.423, reward=0.600' for a tqdm line, None for any other line."""
    matches = list(_TQDM.finditer(line))  # the last bar on the line: an earlier one may be a stale frame
    if not matches:
        return None
    match = matches[-1]
    parts = [match["desc"].strip()] if match["desc"] and match["desc"].strip() else []
    parts += [f"{int(match['pct'])}%", match["count"]]
    postfix = (match["info"] or "").split(", ")[2:]  # after elapsed<remaining and the rate
    return " ".join(parts + [", ".join(p.strip() for p in postfix)]).strip()


def last_error_line(lines: list[str]) -> str | None:
    """The last line that reports an error: `kubealign: error: X` -> X, `pkg.mod.SomeError: X` ->
    `SomeError: X`. None if there is none."""
    for raw in reversed(lines):
        line = _RANK_PREFIX.sub("", raw.strip())
        for pattern in (_CLI_ERROR, _EXCEPTION):
            match = pattern.match(line)
            if match:
                return match["line"].strip()
    return None


class Lines:
    """Incremental line splitter over bytes: feed chunks, get complete lines (decoded, without their
    ending). A trailing "\\r" is held back until the next chunk shows whether "\\n" follows it."""

    _SEP = re.compile(rb"\r\n|\r(?!\Z)|\n")

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        data = self._pending + chunk
        pieces = self._SEP.split(data)
        self._pending = pieces.pop()
        return [p.decode("utf-8", "replace") for p in pieces]

    def close(self) -> list[str]:
        rest, self._pending = self._pending.rstrip(b"\r"), b""
        return [rest.decode("utf-8", "replace")] if rest else []


def shown_path(path: Path) -> str:
    """A path relative to the working directory when it is below it, else absolute: short lines."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 100 else f"{value:.0f} s"


def render_line(state: TaskState, now: float, live: bool = True, width: int = NAME_WIDTH) -> str:
    """One task's line, e.g. 'sft         running   12.3 s  sft 45% 62/138'; a running task's time and
    progress only when `live` (a line printed once would show them as of its start). `width`: the name
    column's (longer names, evaluate-grpo, widen it for the whole display)."""
    head = f"{state.name:<{width}}"
    started = now if state.started is None else state.started
    took = _seconds((now if state.ended is None else state.ended) - started)
    if state.status == RUNNING:
        return f"{head}running  {took:>7}  {state.progress}".rstrip() if live else f"{head}running"
    if state.status == DONE:
        return f"{head}done in {took}"
    if state.status == FAILED:
        after = f" after {took}" if state.started is not None else ""
        log = f"; log: {shown_path(state.log)}" if state.log else ""
        return f"{head}FAILED{after}{log}"
    if state.status == CACHED:
        return f"{head}cached (kfp.local reused an earlier run's outputs)"
    if state.status == STOPPED:
        return f"{head}stopped (interrupted)"
    if state.status == SKIPPED:
        return f"{head}skipped (a task it needs failed)"
    return f"{head}pending"


def name_width(names: list[str]) -> int:
    """The name column: NAME_WIDTH, or one more than the longest name."""
    return max([NAME_WIDTH, *(len(name) + 1 for name in names)])


def render(states: list[TaskState], now: float, width: int = 0) -> list[str]:
    """The display's lines for these states, each cut to `width` columns when width > 0 (a line that
    wraps would break redrawing in place)."""
    column = name_width([state.name for state in states])
    lines = [render_line(state, now, width=column) for state in states]
    return [line[:width] for line in lines] if width > 0 else lines


class Display:
    """Shows task states on `stream`. On a terminal the block of lines is redrawn in place (on every
    change, and twice a second by a ticker thread so a quiet task's time still moves); otherwise one
    line per state change is printed (never a carriage return)."""

    def __init__(self, stream: TextIO, names: list[str], tty: bool | None = None):
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.states = {name: TaskState(name) for name in names}
        self._lock = threading.Lock()
        self._drawn = 0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Display:
        if self.tty:
            self._draw()
            self._ticker = threading.Thread(target=self._tick, name="kubealign-display", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.tty:
            self._draw()

    def state(self, name: str) -> TaskState:
        with self._lock:
            return self.states.setdefault(name, TaskState(name))

    def update(
        self, name: str, status: str | None = None, progress: str | None = None, log: Path | None = None
    ) -> None:
        """Change a task's state; a status change is shown at once (and printed when not a terminal)."""
        state = self.state(name)
        with self._lock:
            changed = status is not None and status != state.status
            if status == RUNNING and changed:
                state.started, state.progress = time.monotonic(), ""
            if status in (DONE, FAILED) and changed:
                state.ended = time.monotonic()
            state.status = status or state.status
            state.progress = progress if progress is not None else state.progress
            state.log = log or state.log
        if changed and not self.tty:
            column = name_width(list(self.states))
            self._write(render_line(state, time.monotonic(), live=False, width=column) + "\n")
        elif changed:
            self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            lines = render(list(self.states.values()), time.monotonic(), width)
            # up to the first line of the block, then rewrite every line (clearing what was there)
            up = f"\x1b[{self._drawn}A\r" if self._drawn else ""
            self.stream.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            self.stream.flush()
            self._drawn = len(lines)

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()
