"""Which rank this process is, asked one way everywhere, without importing torch: the launcher's RANK
(torchrun, the deepspeed launcher; training.distributed.init sets it for a process group of one), else
torch.distributed's rank where a group was made without it, else 0."""

from __future__ import annotations

import os
import sys

# What torchrun / the deepspeed launcher set for a rank. A process that starts a job of its own (a KFP
# task, a torchrun launch) must not pass these on, or the new job tries to join the caller's group.
RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def is_main() -> bool:
    """Rank 0: the one that prints, logs to MLflow and writes shared files."""
    return rank() == 0
