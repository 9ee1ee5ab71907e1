"""How many prompts a rollout can take on this device: what one prompt's rollout holds beyond the resident
engines, against the memory left once they are built. Pure arithmetic over the model's config.

On a GPU the decode step is launch-bound at small batches (OPT-1.3B: ~10 ms a step at batch 16 and 64 alike on
an H200, docs/gpu.md), so a step's cost is nearly the same for 4 prompts as for 64: the generation batch is the
cheapest lever there is, and memory is what bounds it. What grows with it:
* the KV cache: K and V of every layer for every token of prompt + response, per sample;
* the experience pass's log-probs: the LM head's fp32 log-softmax over the vocabulary at the response tokens
  (models.token_logprobs), per sample, for the whole generation batch at once.
Activations of the forward passes are freed layer by layer under no_grad and are left out.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
HEADROOM = 0.8  # of the free memory: the allocator's fragmentation and the update's own peaks


def kv_bytes_per_token(config: Any, dtype: str) -> int:
    """K and V of every layer for one token (transformers config: layers, heads, KV heads, width)."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def prompt_bytes(config: Any, dtype: str, prompt_len: int, new_tokens: int, samples: int) -> int:
    """What one prompt of the generation batch holds: its samples' KV cache and their response log-softmax."""
    kv = kv_bytes_per_token(config, dtype) * (prompt_len + new_tokens)
    logits = new_tokens * config.vocab_size * 4
    return samples * (kv + logits)


def fitting_batch(free_bytes: int, per_prompt: int) -> int:
    """The most prompts whose rollouts fit HEADROOM of the free memory (at least 1)."""
    return max(1, int(free_bytes * HEADROOM) // max(per_prompt, 1))


def note(config: Any, cfg: Any, free_bytes: int) -> str:
    """One line: what the configured generation batch takes of the free memory and how many prompts would fit."""
    per = prompt_bytes(config, cfg.dtype, cfg.max_prompt_len, cfg.max_new_tokens, cfg.group_size)
    batch = cfg.generation_batch_size
    fits = fitting_batch(free_bytes, per)
    gib = 2**30
    verdict = "more would fit" if fits > batch else "the most that fits" if fits == batch else "too many: lower it"
    return (
        f"ppo.generation_batch_size {batch}: about {batch * per / gib:.1f} GiB of KV cache and log-probs of the "
        f"{free_bytes / gib:.1f} GiB free after the engines; about {fits} would fit ({verdict})"
    )
