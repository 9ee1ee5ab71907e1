"""Process-group set-up for one command that runs alone, under torchrun, or under the deepspeed launcher.

torchrun and the deepspeed launcher export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT;
a plain `kubealign sft ...` gets a one-process group on a free loopback port. The backend is NCCL on
CUDA and gloo on CPU (DeepSpeed's CPU accelerator would otherwise pick oneCCL, which is not installed).
"""

from __future__ import annotations

import os
import random
import socket

import torch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed once; returns (rank, world_size)."""
    import deepspeed
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from kubealign.training import ds_prints, oplocks

        with oplocks.guard(oplocks.COMM_OPS), ds_prints.quiet():  # its CPU comm op: no stale lock may hang it
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return dist.get_rank(), dist.get_world_size()


def shutdown(ok: bool) -> None:
    """Tear the process group down before the interpreter exits.

    Left to interpreter exit, gloo's worker threads are destroyed while still joinable and a rank
    aborts with "terminate called without an active exception" (exit 250 under the deepspeed
    launcher, seen in CI at ZeRO-3). After a successful command the ranks meet at a barrier first,
    so no rank tears down while another still talks to it; after an error only this rank's side goes.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if ok and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def world_size() -> int:
    """How many ranks (1 when torch.distributed is not initialized)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few scalars over all ranks (float64, on the backend's device)."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    """The largest of each of a few scalars over all ranks (float64, on the backend's device)."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for torch
        pass


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
