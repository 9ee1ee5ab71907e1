"""Which rank this process is, asked one way everywhere, without importing torch: torch.distributed's rank
once a process group exists, else the launcher's RANK (torchrun, the deepspeed launcher), else 0."""

from __future__ import annotations

import os
import sys


def rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one that prints, logs to MLflow and writes shared files."""
    return rank() == 0
