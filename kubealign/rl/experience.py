"""Rollouts -> experience: masks, actor / reference log-probs, critic values, reward scores.

Generation goes through DeepSpeed's rollout API (HybridEngineRollout) on the hybrid-engine paths and
through the module's generate on the plain-engine path; both return prompt (left-padded) + response.
Everything after the first EOS of a response is padding. All log-prob and value passes run without
dropout (eval mode), so the PPO ratio is exactly 1 before the first update — DeepSpeed-Chat computes
them with dropout live.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from kubealign.models.reward import token_values
from kubealign.rl.losses import entropy_from_logits, logprobs_from_logits
from kubealign.training.losses import last_token_scores, position_ids


class Experience(NamedTuple):
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T] prompt + response tokens through the first EOS
    response_mask: torch.Tensor  # [N, A] actions that produced response tokens (A = T - 1)
    logprobs: torch.Tensor  # [N, A]
    ref_logprobs: torch.Tensor  # [N, A]
    values: torch.Tensor  # [N, A]
    scores: torch.Tensor  # [N] reward-model score of each sequence


def response_masks(
    input_ids: torch.Tensor, prompt_mask: torch.Tensor, response_start: torch.Tensor, eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention_mask [N, T], response_mask [N, T-1]).

    prompt_mask [N, Tp] marks real prompt tokens (left padding); response tokens run from
    response_start through the first EOS (inclusive) or the end. Action t produced token t + 1.
    """
    n, width = input_ids.shape
    positions = torch.arange(width, device=input_ids.device).expand(n, width)
    in_response = positions >= response_start.unsqueeze(1)
    is_eos = (input_ids == eos_id) & in_response
    # Tokens strictly after the first EOS are padding: count EOS seen before each position.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    response_tokens = in_response & (eos_before == 0)
    prompt_part = torch.zeros_like(response_tokens)
    prompt_part[:, : prompt_mask.shape[1]] = prompt_mask.bool()
    attention = (prompt_part & ~in_response) | response_tokens
    return attention.long(), response_tokens[:, 1:].long()


def forward_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask), use_cache=False
    ).logits


def sequence_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return logprobs_from_logits(forward_logits(model, input_ids, attention_mask), input_ids)


def logprobs_and_entropy(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    logits = forward_logits(model, input_ids, attention_mask)
    return logprobs_from_logits(logits, input_ids), entropy_from_logits(logits)


@contextlib.contextmanager
def merged_lora(module: Any) -> Iterator[None]:
    """Merge PEFT LoRA adapters into the base weights for generation, unmerge after. The hybrid engine's
    injected kernels read the base weights only; merging keeps generation equal to the adapter model.
    Under ZeRO-3 the parameters are gathered with rank 0 as the modifier, so every rank sees the merge."""
    if not hasattr(module, "merge_adapter"):
        yield
        return
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        module.merge_adapter()
    try:
        yield
    finally:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            module.unmerge_adapter()


def score_and_value(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(per-action values [N, A], sequence scores [N]) from a reward/critic model in one pass."""
    values = token_values(model, input_ids, attention_mask)
    return values[:, :-1], last_token_scores(values, attention_mask)


@torch.no_grad()
def make_experience(
    batch: Any, prompt_mask: torch.Tensor, eos_id: int, actor: Any, reference: Any, critic: Any, reward: Any
) -> Experience:
    """batch: a RolloutBatch (input_ids, response_start_idx) for left-padded prompts with prompt_mask."""
    input_ids = batch.input_ids
    prompt_mask = prompt_mask.to(input_ids.device)
    if prompt_mask.shape[0] != input_ids.shape[0]:  # n_samples_per_prompt > 1: prompts were repeated
        prompt_mask = prompt_mask.repeat_interleave(input_ids.shape[0] // prompt_mask.shape[0], dim=0)
    attention, response = response_masks(input_ids, prompt_mask, batch.response_start_idx, eos_id)
    for model in (actor, reference, critic, reward):
        model.eval()
    logprobs = sequence_logprobs(actor, input_ids, attention)
    ref_logprobs = sequence_logprobs(reference, input_ids, attention)
    values, _ = score_and_value(critic, input_ids, attention)
    _, scores = score_and_value(reward, input_ids, attention)
    return Experience(input_ids, attention, response, logprobs, ref_logprobs, values.float(), scores.float())
