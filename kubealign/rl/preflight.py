"""Choose the actor's rollout path before anything is built, from facts measured with DeepSpeed 0.19.8.

Paths:
* "he-injected" — DeepSpeedHybridEngine with kernel injection: CUDA, an architecture DeepSpeed has an
  inference policy for (OPT, BLOOM, GPT-J, GPT-Neo, GPT-NeoX, LLaMA without GQA, InternLM) and a
  transformers release its kernels were known to work with (<= 4.48).
* "he-plain" — DeepSpeedHybridEngine without injection: measured to train and generate (through the
  rollout API) on CPU for OPT. DeepSpeed's own engine.generate() is broken there, so generation always
  goes through deepspeed.runtime.rollout.HybridEngineRollout.
* "engine" — a plain DeepSpeed engine, generation through the module: every other case (hybrid engine
  disabled, an architecture the hybrid engine cannot even initialize on CPU such as LLaMA, or CUDA
  with a transformers release the injected kernels do not support).

An impossible combination never crashes: it becomes a note and a safe setting, and the chosen path is
logged as a run parameter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from packaging.version import Version

INJECTION_POLICIES = {"opt", "bloom", "gptj", "gpt_neo", "gpt_neox", "llama", "internlm"}
HE_PLAIN_ON_CPU = {"opt"}  # measured: trains, and generates through the rollout API
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


def decide(
    hybrid: Any,
    actor_zero_stage: int,
    model_type: str,
    num_attention_heads: int,
    num_key_value_heads: int | None,
    cuda: bool,
    transformers_version: str,
) -> Preflight:
    """hybrid: a HybridEngineConfig (enabled, max_out_tokens, inference_tp_size, ...)."""
    notes: list[str] = []
    if not hybrid.enabled:
        return Preflight("engine", None, ["ppo.hybrid_engine.enabled is false: plain DeepSpeed engine"])
    block = hybrid_block(hybrid)
    if hybrid.inference_tp_size > 1 and (actor_zero_stage != 3 or not cuda):
        why = "needs the actor at ZeRO-3" if cuda else "needs CUDA"
        notes.append(f"ppo.hybrid_engine.inference_tp_size {hybrid.inference_tp_size} {why}: using 1")
        block["inference_tp_size"] = 1
    if not cuda:
        if model_type in HE_PLAIN_ON_CPU:
            notes.append(f"no kernel injection on CPU: hybrid engine without injection for {model_type}")
            return Preflight("he-plain", block, notes)
        notes.append(f"DeepSpeed's hybrid engine cannot initialize {model_type} on CPU: plain engine")
        return Preflight("engine", None, notes)
    gqa = num_key_value_heads is not None and num_key_value_heads != num_attention_heads
    if model_type not in INJECTION_POLICIES or (model_type == "llama" and gqa):
        what = "LLaMA with grouped-query attention" if gqa else model_type
        notes.append(f"DeepSpeed has no kernel-injection policy for {what}: plain engine")
        return Preflight("engine", None, notes)
    if Version(transformers_version) >= MAX_KERNEL_TRANSFORMERS:
        notes.append(
            f"transformers {transformers_version} is newer than the hybrid engine's kernels support (<= 4.48): "
            "plain engine"
        )
        return Preflight("engine", None, notes)
    notes.append(f"kernel-injected hybrid engine for {model_type}")
    return Preflight("he-injected", block, notes)
