"""DeepSpeed's bare print() lines, kept off a stage's screen unless asked for (-v, KUBEALIGN_VERBOSE=1).

Two reach the screen of every CPU stage and read like news or like trouble when they are neither: "DeepSpeed
deepspeed_shm_comm built successfully" (each deepspeed.init_distributed loads the comm op, built or not) and
"Using fallback functions in workspace because of ..." (the hybrid engine's workspace without inference
kernels, which the preflight's note already says). They are print()s, not log records, so the logging filter
of cli.training.quiet_libraries does not see them: stdout is filtered line by line around the DeepSpeed calls
that print them, and every other line passes unchanged.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator

NOISE = ("built successfully", "Using fallback functions in workspace")
VERBOSE_ENV = "KUBEALIGN_VERBOSE"


class _Filtered(io.TextIOBase):
    """A text stream that passes whole lines to `out` except those containing a NOISE text."""

    def __init__(self, out: io.TextIOBase):
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not any(noise in line for noise in NOISE):
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def close_line(self) -> None:
        if self.pending and not any(noise in self.pending for noise in NOISE):
            self.out.write(self.pending)
        self.pending = ""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DeepSpeed's NOISE lines printed inside the block dropped, unless KUBEALIGN_VERBOSE is set."""
    if os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0"):
        yield
        return
    filtered = _Filtered(sys.stdout)
    with contextlib.redirect_stdout(filtered):
        try:
            yield
        finally:
            filtered.close_line()
