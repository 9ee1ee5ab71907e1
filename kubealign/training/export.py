"""Export a trained engine's model as a self-contained Hugging Face dir (ZeRO-3 and LoRA aware).

Parameters are gathered one at a time (ZeRO-3 partitions them across ranks), so no rank ever holds a
second full copy in GPU memory; rank 0 keeps a CPU copy. Every rank hashes the gathered values in
the same order, which lets a test check that all ranks agree on the model that rank 0 saves. LoRA
adapters are merged on a fresh CPU model (PEFT merge_and_unload), away from DeepSpeed's hooks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from kubealign.config.schema import LoraConfig


def gather_state(module: torch.nn.Module, keep: bool) -> tuple[dict[str, torch.Tensor], str]:
    """(full state dict on CPU if keep else {}, sha256 of all gathered parameters and buffers)."""
    import deepspeed

    digest = hashlib.sha256()
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            value = param.detach().to("cpu", copy=True)
        digest.update(name.encode())
        digest.update(value.float().numpy().tobytes())
        if keep:
            state[name] = value
    for name, buffer in module.named_buffers():
        if keep:
            state[name] = buffer.detach().to("cpu", copy=True)
    return state, digest.hexdigest()


def build_cpu_model(model_cls: Any, base_config: Any, lora: LoraConfig, task_type: str, state: dict) -> Any:
    """A fresh CPU model of the trained architecture with `state` loaded (LoRA adapters still separate)."""
    from kubealign.training.engine import apply_lora

    model = apply_lora(model_cls.from_config(base_config), lora, task_type)
    buffers = dict(model.named_buffers())  # non-persistent ones (rotary inv_freq) are not in state_dict()
    state = {k: v for k, v in state.items() if k not in buffers or k in model.state_dict()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the input embeddings
    if missing or unexpected:
        raise RuntimeError(f"exported state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def gather_model(engine: Any, model_cls: Any, lora: LoraConfig, task_type: str) -> tuple[Any, list[str]]:
    """All ranks: gather the engine's parameters. Returns (a plain CPU model on rank 0 — adapters not
    yet merged — or None elsewhere, every rank's parameter hash)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    module = engine.module
    base_config = module.get_base_model().config if hasattr(module, "get_base_model") else module.config
    state, digest = gather_state(module, keep=rank == 0)
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, digest)
    model = build_cpu_model(model_cls, base_config, lora, task_type, state) if rank == 0 else None
    return model, hashes


def write_model(model: Any, lora: LoraConfig, tokenizer: Any, directory: Path) -> None:
    """save_pretrained (safetensors, adapters merged; the adapter itself too if lora.save_adapter) and
    the tokenizer into `directory`."""
    if lora.r and lora.save_adapter:
        model.save_pretrained(directory / "adapter")
    merged = model.merge_and_unload() if lora.r else model
    merged.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def export(
    engine: Any,
    model_cls: Any,
    lora: LoraConfig,
    task_type: str,
    tokenizer: Any,
    output: Path,
    result: dict,
    extra_json: dict[str, Any] | None = None,
) -> list[str]:
    """Write the trained model + tokenizer + result.json (+ extra JSON files) to `output`, atomically,
    from rank 0. Returns every rank's parameter hash (they must all be equal)."""
    from kubealign.outputs import atomic_dir, write_json, write_result
    from kubealign.training import distributed

    model, hashes = gather_model(engine, model_cls, lora, task_type)
    if model is not None:
        with atomic_dir(output) as tmp:
            write_model(model, lora, tokenizer, tmp)
            for name, payload in (extra_json or {}).items():
                write_json(tmp / name, payload)
            write_result(tmp, **result, rank_param_sha256=hashes)
    distributed.barrier()
    return hashes


def state_sha256(model: torch.nn.Module) -> str:
    """The same hash as gather_state computes, for a plain (non-ZeRO) model."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
