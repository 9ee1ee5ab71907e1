"""The rollout path the ppo stage must take for the tiny OPT on this CPU, from the installed transformers'
OPT layer signature (the fact DeepSpeed 0.19.8 decides injection from), independent of the preflight's code:
transformers 5.0-5.23 keep `past_key_values` (DeepSpeed injects nothing: the hybrid engine runs without
injection); 5.24 renamed it `cache` (DeepSpeed would inject, CPU has no kernels: the plain engine)."""

from __future__ import annotations

import inspect


def cpu_opt_path() -> str:
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    params = inspect.signature(OPTDecoderLayer.forward).parameters
    return "he-plain" if "past_key_values" in params or "cache_position" in params else "engine"
