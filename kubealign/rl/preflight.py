"""Choose the actor's rollout path before anything is built.

Whether the hybrid engine injects its inference kernels is asked of DeepSpeed itself (`would_inject`:
the policy table its DeepSpeedHybridEngine builds at initialization, over the model's own layer classes),
not read off a version list: DeepSpeed decides it from transformers' layer signatures, so a transformers
release that renames one argument turns injection on or off (5.24 renamed OPT's `past_key_values` to
`cache`, and DeepSpeed 0.19.8 then injects into OPT, which on CPU dies in deepspeed.initialize with
"This op had not been implemented on CPU backend"). Whether the device has the kernels is asked of
DeepSpeed's accelerator (`inference_kernels`).

Paths:
* "he-injected" — DeepSpeedHybridEngine with kernel injection: DeepSpeed injects, the device has the
  kernels, no LLaMA with grouped-query attention, and a transformers release the kernels were known to
  work with (<= 4.48: their legacy tuple-cache contract).
* "he-plain" — DeepSpeedHybridEngine without injection (DeepSpeed keeps the model's native generate):
  measured to train and generate (through the rollout API) on CPU for OPT, and on CUDA for OPT at actor
  ZeRO <= 2 (an H200, 2026-11-27: docs/gpu.md). DeepSpeed's own engine.generate() is broken there, so
  generation always goes through HybridEngineRollout.
* "engine" — a plain DeepSpeed engine, generation through the module: every other case (hybrid engine
  disabled, injection the device has no kernels for, or kernels the transformers release does not fit).

An impossible combination never crashes: it becomes a note and a safe setting, and the chosen path is
logged as a run parameter.
"""

from __future__ import annotations

import logging
import types
from typing import Any, NamedTuple

from packaging.version import Version

INJECTION_POLICIES = {"opt", "bloom", "gptj", "gpt_neo", "gpt_neox", "llama", "internlm"}
HE_PLAIN_ON_CPU = {"opt"}  # measured: trains, and generates through the rollout API
# Measured on CUDA (an H200; benchmarks/results/gpu-correctness-nvidia-h200.json, gpu-generation-...): OPT-1.3B
# at ZeRO 2 passed the correctness check (ratio 1 and KL 0 at step 0, greedy tokens equal to HF eager's) and
# decoded at 8.8 ms a step against HF eager's 9.6 (batch 16); the plain engine's path was not measured there.
# ZeRO 3 (partitioned weights gathered for generation) was not measured on CUDA: it keeps the plain engine.
HE_PLAIN_ON_CUDA = {"opt"}
HE_PLAIN_CUDA_MAX_ZERO = 2
MAX_KERNEL_TRANSFORMERS = Version("4.49")  # injected kernels known-good up to 4.48.x


class Preflight(NamedTuple):
    path: str  # he-injected | he-plain | engine
    hybrid_engine: dict[str, Any] | None  # the DeepSpeed `hybrid_engine` block, None for "engine"
    notes: list[str]  # why, in one line each


def hybrid_block(hybrid: Any) -> dict[str, Any]:
    """The DeepSpeed `hybrid_engine` config block of a HybridEngineConfig, before any adjustment."""
    return {
        "enabled": True,
        "max_out_tokens": hybrid.max_out_tokens,
        "inference_tp_size": hybrid.inference_tp_size,
        "release_inference_cache": hybrid.release_inference_cache,
        "pin_parameters": hybrid.pin_parameters,
        "tp_gather_partition_size": hybrid.tp_gather_partition_size,
    }


def would_inject(model: Any) -> list[str]:
    """The layer classes of `model` (a transformers module) that DeepSpeed's hybrid engine would replace by
    its inference kernels at initialization: DeepSpeedHybridEngine.populate_all_inference_policies, the
    very function its __init__ calls, run over the model without building an engine. [] = DeepSpeed keeps
    the model's native generate (and logs so itself; that warning is silenced here, the preflight's note
    says it)."""
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.utils import logger

    probe = types.SimpleNamespace(module=model, new_inference_container=None)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        DeepSpeedHybridEngine.populate_all_inference_policies(probe)
    finally:
        logger.setLevel(level)
    # A transformer layer maps to (container factory, policy); the auxiliary layers (Linear, LayerNorm, ...)
    # to a one-element tuple, and are replaced only alongside a transformer layer.
    layers = {cls for cls, entry in probe.inference_policies.items() if len(entry) == 2}
    return sorted({type(m).__name__ for m in model.modules() if type(m) in layers})


def inference_kernels() -> tuple[bool, str]:
    """(whether this device has DeepSpeed's transformer inference kernels, why not): the accelerator's
    InferenceBuilder, which the injected layers load. CPU's is DeepSpeed's NotImplementedBuilder."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    name = accelerator.device_name()
    builder = accelerator.create_op_builder("InferenceBuilder")
    if builder is None or type(builder).__name__ == "NotImplementedBuilder":
        return False, f"DeepSpeed implements no inference kernels on {name}"
    if not builder.is_compatible(verbose=False):
        return False, f"DeepSpeed's inference kernels cannot be built or loaded on this {name} setup"
    return True, ""


def decide(
    hybrid: Any,
    actor_zero_stage: int,
    model_type: str,
    num_attention_heads: int,
    num_key_value_heads: int | None,
    cuda: bool,
    transformers_version: str,
    injected: list[str],
    kernels: tuple[bool, str],
) -> Preflight:
    """hybrid: a HybridEngineConfig (enabled, max_out_tokens, inference_tp_size, ...); injected: would_inject's
    answer for the actor; kernels: inference_kernels()'s."""
    notes: list[str] = []
    if not hybrid.enabled:
        return Preflight("engine", None, ["ppo.hybrid_engine.enabled is false: plain DeepSpeed engine"])
    block = hybrid_block(hybrid)
    if hybrid.inference_tp_size > 1 and (actor_zero_stage != 3 or not cuda):
        why = "needs the actor at ZeRO-3" if cuda else "needs CUDA"
        notes.append(f"ppo.hybrid_engine.inference_tp_size {hybrid.inference_tp_size} {why}: using 1")
        block["inference_tp_size"] = 1
    tf = f"transformers {transformers_version}"
    if not injected:
        measured = model_type in (HE_PLAIN_ON_CUDA if cuda else HE_PLAIN_ON_CPU)
        if measured and (not cuda or actor_zero_stage <= HE_PLAIN_CUDA_MAX_ZERO):
            notes.append(f"DeepSpeed injects no kernels into {model_type} under {tf}: hybrid engine without injection")
            return Preflight("he-plain", block, notes)
        if not cuda:
            where = "measured on CPU only for " + ", ".join(sorted(HE_PLAIN_ON_CPU))
        elif measured:
            where = f"without injection measured on CUDA at actor ZeRO <= {HE_PLAIN_CUDA_MAX_ZERO} only"
        else:
            only = ", ".join(sorted(HE_PLAIN_ON_CUDA))
            where = f"nothing to inject; without injection measured on CUDA only for {only}"
        notes.append(f"DeepSpeed injects no kernels into {model_type} under {tf} ({where}): plain engine")
        return Preflight("engine", None, notes)
    layers = ", ".join(injected)
    available, why = kernels
    if not available:
        notes.append(f"DeepSpeed would inject its inference kernels into {layers} under {tf}, but {why}: plain engine")
        return Preflight("engine", None, notes)
    gqa = num_key_value_heads is not None and num_key_value_heads != num_attention_heads
    if model_type not in INJECTION_POLICIES or (model_type == "llama" and gqa):
        what = "LLaMA with grouped-query attention" if gqa else model_type
        notes.append(f"DeepSpeed's kernel-injection policy does not fit {what}: plain engine")
        return Preflight("engine", None, notes)
    if Version(transformers_version) >= MAX_KERNEL_TRANSFORMERS:
        notes.append(f"{tf} is newer than the hybrid engine's injected kernels support (<= 4.48): plain engine")
        return Preflight("engine", None, notes)
    notes.append(f"kernel-injected hybrid engine for {model_type} ({layers})")
    return Preflight("he-injected", block, notes)
