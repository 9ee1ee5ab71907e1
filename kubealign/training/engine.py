"""A DeepSpeed engine for one trainable model: ZeRO config, AdamW param groups, LoRA, HF scheduler.

The DeepSpeed config is a pure function of the stage config (ds_config), so it can be tested and
logged. AdamW comes from DeepSpeed's config block: fused Adam on CUDA, DeepSpeedCPUAdam when the
optimizer is offloaded, torch's AdamW (`torch_adam`) with its fused CPU kernel on CPU.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from kubealign.config.schema import LoraConfig, TrainConfig

log = logging.getLogger(__name__)
NO_DECAY = ("bias", "norm", "layernorm", "layer_norm", "ln_")

# Without CUDA, DeepSpeed probes for every accelerator it knows, finds none and warns "Setting
# accelerator to CPU" in every process. kubealign trains on CUDA or the CPU only, so say which up front
# (DeepSpeed's documented override, read when it is first imported: every stage imports this module
# before deepspeed). An explicit DS_ACCELERATOR still wins.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(cfg: TrainConfig, world_size: int, cuda: bool) -> dict[str, Any]:
    """The DeepSpeed JSON config of a training stage."""
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    offload = cfg.offload and cuda
    if cfg.offload and not cuda:
        log.warning("offload has no effect without an accelerator: the model is on the CPU already; ignored")
    if offload and cfg.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload and cfg.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if cfg.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False, stage3_param_persistence_threshold=1e4)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation_steps * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "fp16": {"enabled": cfg.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.learning_rate,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                "torch_adam": not cuda,
                # torch's fused CPU kernel: one pass over each tensor instead of a dozen elementwise ops
                # (7.7 -> 2.4 ms per step for 3.5M parameters); same update up to float rounding.
                **({} if cuda else {"fused": True}),
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.gradient_clipping > 0:
        config["gradient_clipping"] = cfg.gradient_clipping
    return config


@contextlib.contextmanager
def zero3_loading(config: dict[str, Any]) -> Iterator[None]:
    """Load models inside this block: under ZeRO-3, transformers then builds them within
    deepspeed.zero.Init, partitioned across ranks while loading, instead of a full copy on every rank
    (8 x 26 GB of host memory for OPT-13B in bf16). Outside it, models load normally again — the
    export rebuilds a plain CPU model on rank 0 alone."""
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(config)  # transformers holds only a weak reference
    try:
        yield
    finally:
        del keep_alive
        unset_hf_deepspeed_config()


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases and norms; LoRA parameters at their own rate."""
    lora_lr = cfg.lora.learning_rate or cfg.learning_rate
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not any(k in name.lower() for k in NO_DECAY)
        groups.setdefault(("lora_" in name, decay), []).append(param)
    return [
        {
            "params": params,
            "weight_decay": cfg.weight_decay if decay else 0.0,
            "lr": lora_lr if is_lora else cfg.learning_rate,
        }
        for (is_lora, decay), params in sorted(groups.items())
    ]


def apply_lora(model: torch.nn.Module, lora: LoraConfig, task_type: str) -> torch.nn.Module:
    """Wrap with PEFT LoRA adapters. Unless only_lora, the base weights stay trainable too (as in
    DeepSpeed-Chat with only_optimize_lora off)."""
    if lora.r == 0:
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in lora.target_modules if t in present]
    if not targets:
        from kubealign.errors import UserError

        raise UserError(
            f"lora.target_modules {lora.target_modules} match no module of this model "
            f"(linear layers it has: {sorted(n for n in present if 'proj' in n or n.startswith('fc'))})"
        )
    peft_config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type=task_type,
    )
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` property inside
        # get_peft_model (peft_model.py); nothing on our side calls it, so only that one warning goes.
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        wrapped = get_peft_model(model, peft_config)
    if not lora.only_lora:
        for name, param in wrapped.named_parameters():
            if "lora_" not in name:
                param.requires_grad_(True)
    return wrapped


def create(model: torch.nn.Module, cfg: TrainConfig, config: dict[str, Any], total_steps: int) -> Any:
    """deepspeed.initialize with our param groups and an HF schedule over total_steps optimizer steps."""
    import deepspeed
    from transformers import get_scheduler

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def scheduler(optimizer: torch.optim.Optimizer) -> Any:
        name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else cfg.lr_scheduler
        return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps)

    from kubealign.training import ds_prints, oplocks

    with oplocks.guard(), ds_prints.quiet():  # DeepSpeed may JIT-build its optimizer op (fused / CPU Adam) in here
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg), config=config, lr_scheduler=scheduler
        )
    if config["zero_optimization"]["stage"] == 0 and engine.dp_world_size == 1:
        # Alone, the engine's gradient all-reduce only flattens every gradient into a bucket, "reduces" it
        # over one rank, divides by 1 and copies it back; DeepSpeed skips it itself without a process group.
        # (It also gives unused parameters zero gradients, which AdamW then decays: here they keep none,
        # as in plain torch.) ZeRO >= 1 does its partitioning there, so only stage 0.
        engine.enable_backward_allreduce = False
    return engine


def trainable(
    model: torch.nn.Module,
    cfg: TrainConfig,
    task_type: str,
    world_size: int,
    total_steps: int,
    hybrid_engine: dict[str, Any] | None = None,
) -> Any:
    """LoRA (if configured) + a DeepSpeed engine; with a `hybrid_engine` block, a DeepSpeedHybridEngine."""
    model = apply_lora(model, cfg.lora, task_type)
    config = ds_config(cfg, world_size, torch.cuda.is_available())
    if hybrid_engine:
        config["hybrid_engine"] = hybrid_engine
        return latency_report_to_log(create(model, cfg, config, total_steps))
    return create(model, cfg, config, total_steps)


def latency_report_to_log(engine: Any) -> Any:
    """DeepSpeedHybridEngine.eval() print()s an "|E2E latency=... |Generate time=..." line on every call
    after the first (DeepSpeed-Chat's timing report; a bare print, so no logger level turns it off): once
    per PPO iteration and evaluation. Send those lines to our logger at DEBUG instead of stdout."""
    hybrid_eval = engine.eval

    def quiet_eval() -> Any:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            result = hybrid_eval()
        for line in printed.getvalue().splitlines():
            log.debug("hybrid engine: %s", line)
        return result

    engine.eval = quiet_eval
    return engine


def frozen(
    model: torch.nn.Module, zero_stage: int, dtype: str, offload: bool, micro_batch: int, world_size: int
) -> Any:
    """A model that only runs forward passes (PPO's reference and reward): partitioned by a DeepSpeed
    engine without optimizer at ZeRO-3 (parameters offloaded to CPU if asked, with an accelerator),
    otherwise the plain module on the device."""
    from kubealign.training import distributed

    model.requires_grad_(False)
    if zero_stage != 3:
        return model.to(distributed.device()).eval()
    import deepspeed

    zero: dict[str, Any] = {"stage": 3}
    if offload and torch.cuda.is_available():
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "train_batch_size": micro_batch * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
        "steps_per_print": 10**9,
    }
    from kubealign.training import ds_prints

    with ds_prints.quiet():
        engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
