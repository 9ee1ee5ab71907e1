"""What the TRL benchmarks share (trl_compare.py for SFT / reward / DPO, trl_grpo.py for GRPO): a counter of
the real tokens and slots each training forward sees (and the process's peak resident memory over the timed
steps), the TRL callback that marks its steps, and TRL run as in a process of its own. A module of its own so
that neither benchmark imports the other."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class Counter:
    """Real tokens and token slots of every training forward of a model (a forward pre-hook), with the
    time and the counts at the end of each optimizer step."""

    def __init__(self, model: torch.nn.Module | None):
        """model: the one whose training forwards are counted; None: the caller counts its batches (add)."""
        self.real = self.slots = 0
        self.marks: list[tuple[float, int, int]] = []
        self.losses: list[float] = []
        if model is not None:
            model.register_forward_pre_hook(self._count, with_kwargs=True)

    def add(self, attention_mask: torch.Tensor) -> None:
        """A batch's real tokens and slots, counted by the caller: kubealign's DPO runs each pair's prompt
        once (models.shared_prompt), so its forwards see fewer tokens than the pairs hold; what both sides
        count is the pairs' tokens, prompt twice, as TRL's forward takes them."""
        self.real, self.slots = self.real + int(attention_mask.sum()), self.slots + attention_mask.numel()

    def _count(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
        if mask is not None and mask.dim() == 2:
            self.real, self.slots = self.real + int(mask.sum()), self.slots + mask.numel()
        else:  # padding-free: one row of real tokens
            self.real, self.slots = self.real + ids.numel(), self.slots + ids.numel()

    def mark(self) -> None:
        if not self.marks:  # the timed steps start: the peak is counted from here (both sides alike)
            self.rss_start = reset_peak_rss()
        self.marks.append((time.perf_counter(), self.real, self.slots))

    def figures(self) -> dict[str, float]:
        (t0, r0, s0), (t1, r1, s1) = self.marks[0], self.marks[-1]
        out = {"seconds": t1 - t0, "real_tokens": r1 - r0, "slots": s1 - s0}
        if self.rss_start is not None:
            out["peak_rss_above_start_bytes"] = status_bytes("VmHWM") - self.rss_start
        return out

    rss_start: int | None = None


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int | None:
    """Reset the process's resident peak (Linux: 5 to /proc/self/clear_refs sets VmHWM to VmRSS) and return
    the resident size it starts from; None where the kernel does not allow it (no peak is then reported)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return status_bytes("VmRSS")


def trl_callback(counter: Counter) -> Any:
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            counter.mark()

        def on_step_end(self, args, state, control, **kw):
            counter.mark()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                counter.losses.append(float(logs["loss"]))

    return Marks()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """TRL as in a process of its own: without the rendezvous variables of kubealign's one-rank group (set by
    distributed.init for the DeepSpeed engines), which would make accelerate wrap TRL's model in DDP."""
    from kubealign.ranks import RENDEZVOUS_ENV

    saved = {k: os.environ.pop(k) for k in RENDEZVOUS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
