"""Which training examples share a micro-batch: a plan that is a pure function of (lengths, seed, epoch).

Every batch is right-padded to its longest member, so a micro-batch of a short and a long sequence spends
most of its compute on padding. On HH-RLHF at DeepSpeed-Chat's lengths, random batches of 8 are about half
padding (docs/padding-free.md). "grouped" puts sequences of similar length together: the epoch's shuffled
order is cut into windows of WINDOW global micro-batches, each window sorted by length (longest first, ties
in shuffled order) and cut into micro-batches, and the micro-batches of the whole epoch are shuffled again
so that training does not see the long ones first (HF Trainer's group_by_length works the same way, with
its megabatches of 50). "padded" is the plain shuffled order.

Packing several sequences into one row instead would remove the last padding too, but needs an attention
kernel that stops at sequence boundaries: on CPU, SDPA has none, and a block-diagonal mask costs attention
over the whole packed row (docs/padding-free.md has the measurement), so grouping is what runs here.

A plan is a list of global micro-batches in training order, each a list of `world` per-rank index lists of
`micro` examples. Examples that do not fill a whole optimizer step at the end of an epoch are left out of
that epoch (as DistributedSampler's drop_last), so every step has the same number of sequences on every
rank, and a pair loss averaged per micro-batch is the step's mean over its pairs however they are grouped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WINDOW = 50  # global micro-batches sorted together: wide enough to find equal lengths, narrow enough to stay random
MODES = ("grouped", "padded")

Plan = list[list[list[int]]]  # [global micro-batch][rank] -> example indices


def epoch_plan(
    lengths: Sequence[int], micro: int, world: int, accumulation: int, seed: int, epoch: int, mode: str
) -> Plan:
    """The epoch's micro-batches for every rank; a whole number of optimizer steps of `accumulation`
    global micro-batches each. Deterministic in (lengths, micro, world, accumulation, seed, epoch, mode)."""
    if mode not in MODES:
        raise ValueError(f"batching mode {mode!r}: expected one of {', '.join(MODES)}")
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    width = micro * world
    usable = len(order) // (width * accumulation) * width * accumulation
    order = order[:usable]
    if mode == "padded":
        globals_ = [order[i : i + width] for i in range(0, usable, width)]
    else:
        globals_ = []
        for start in range(0, usable, width * WINDOW):
            window = sorted(order[start : start + width * WINDOW], key=lambda i: -lengths[i])
            globals_ += [window[i : i + width] for i in range(0, len(window), width)]
        shuffled = torch.randperm(len(globals_), generator=generator).tolist()
        globals_ = [globals_[i] for i in shuffled]
    return [[batch[r * micro : (r + 1) * micro] for r in range(world)] for batch in globals_]


def step_units(plan: Plan, units: Sequence[int], accumulation: int) -> list[int]:
    """Per optimizer step, the sum of `units` (e.g. loss tokens) over every example of the step, all ranks:
    what a token-mean loss divides by so that the step's loss does not depend on the grouping."""
    totals = []
    for start in range(0, len(plan), accumulation):
        totals.append(sum(units[i] for batch in plan[start : start + accumulation] for rank in batch for i in rank))
    return totals


def padding_share(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """The share of token slots that are padding when each batch (of example indices) is padded to its
    longest member: 1 - real tokens / (rows x longest), over all batches."""
    real = sum(lengths[i] for batch in batches for i in batch)
    slots = sum(len(batch) * max((lengths[i] for i in batch), default=0) for batch in batches)
    return 1.0 - real / slots if slots else 0.0


def sorted_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Evaluation batches: every example once, longest first (an evaluation's sums do not depend on order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]
