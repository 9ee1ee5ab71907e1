"""Rollouts -> experience: masks, actor / reference log-probs, critic values, reward scores.

Generation goes through DeepSpeed's rollout API (HybridEngineRollout) on the hybrid-engine paths and
through the module's generate on the plain-engine path; both return prompt (left-padded) + response.
Everything after the first EOS of a response is padding. Log-probs describe the distribution that
sampled (temperature, top-k, top-p: kubealign.rl.losses.sampling_logits). The actor is in eval mode while
it generates (the hybrid engine's inference kernels) and in train mode for every log-prob pass, with its
dropout disabled, so the PPO ratio is exactly 1 before the first update — DeepSpeed-Chat computes them
with dropout live.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from kubealign.models.reward import token_values
from kubealign.rl.losses import Sampling, logprobs_and_entropy, logprobs_from_logits, restrict_to, sampling_logits
from kubealign.training.losses import last_token_scores, position_ids


class Experience(NamedTuple):
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T] prompt + response tokens through the first EOS
    response_mask: torch.Tensor  # [N, A] actions that produced response tokens (A = T - 1)
    logprobs: torch.Tensor  # [N, A]
    ref_logprobs: torch.Tensor  # [N, A]
    values: torch.Tensor | None  # [N, A] critic values; None without a critic (grpo, rloo)
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


def forward_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int = 0) -> torch.Tensor:
    """[N, T - first, V] logits of positions first..T-1 (a causal LM's logits_to_keep: the LM head and
    everything after it skip the prompt); all T positions for first 0 or a model without logits_to_keep."""
    keep = {"logits_to_keep": input_ids.shape[1] - first} if first > 0 and keeps_logits(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                   use_cache=False, **keep).logits  # fmt: skip
    return logits if keep else logits[:, first:]


def keeps_logits(model: Any) -> bool:
    """Whether the causal LM under the engine / PEFT wrappers takes logits_to_keep (transformers' LMs do)."""
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def first_response_action(response_mask: torch.Tensor) -> int:
    """The first action column that any row's response occupies: the actions before it are prompt for
    every row, so no log-prob pass needs their logits (left-padded prompts: the prompt width - 1)."""
    columns = response_mask.any(0)
    return int(columns.int().argmax()) if bool(columns.any()) else 0


def action_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                  sampling: Sampling) -> tuple[torch.Tensor, int]:  # fmt: skip
    """(sampling_logits of positions first..T-1, first = first_response_action): what every action from
    `first` on needs; the actions before it get 0 (left_pad)."""
    first = first_response_action(response_mask)
    return sampling_logits(forward_logits(model, input_ids, attention_mask, first), sampling), first


def left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """[N, A - width] -> [N, A]: zeros for the first `width` actions."""
    return torch.nn.functional.pad(x, (width, 0))


def generation_config(sampling: Sampling, max_new_tokens: int, tokenizer: Any) -> Any:
    """A GenerationConfig that samples from exactly sampling_logits(logits, sampling): every other logits
    processor spelled out as off, since any setting left unset is filled from the model's own
    generation_config.json (transformers' default top_k is 50; a checkpoint may add a repetition penalty)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def response_only(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """x on response actions, 0 elsewhere (also where x is -inf: a prompt token outside a top-k filter)."""
    return torch.where(response_mask.bool(), x, torch.zeros_like(x))


def policy_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                    sampling: Sampling, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(log-probs, entropies) [N, A] of the policy's sampling distribution (temperature, top-k, top-p) on
    the response actions, 0 elsewhere. entropy_grad False: the entropy carries no gradient (logging only)."""
    logits, first = action_logits(model, input_ids, attention_mask, response_mask, sampling)
    logprobs, entropy = logprobs_and_entropy(logits, input_ids[:, first:], entropy_grad, response_mask[:, first:])
    logprobs, entropy = left_pad(logprobs, first), left_pad(entropy, first)
    return response_only(logprobs, response_mask), response_only(entropy, response_mask)


def paired_logprobs(sampler: Any, other: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_mask: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(sampler's, other's) log-probs [N, A] of the sampled response tokens, 0 elsewhere: the sampler's
    under its sampling distribution, the other model's (reference, baseline) at the same temperature over
    the tokens the sampler could draw (losses.restrict_to) — so their difference estimates a finite KL
    that is exactly 0 for two copies of one model."""
    logits, first = action_logits(sampler, input_ids, attention_mask, response_mask, sampling)
    logprobs = left_pad(logprobs_from_logits(logits, input_ids[:, first:]), first)
    truncated = sampling.top_k > 0 or sampling.top_p < 1
    outside = torch.isinf(logits) if truncated else None  # a bool mask, not a second [N, T, V] of floats
    del logits
    other_logits = restrict_to(forward_logits(other, input_ids, attention_mask, first), outside, sampling)
    other_logprobs = left_pad(logprobs_from_logits(other_logits, input_ids[:, first:]), first)
    return response_only(logprobs, response_mask), response_only(other_logprobs, response_mask)


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
    batch: Any,
    prompt_mask: torch.Tensor,
    eos_id: int,
    models: tuple[Any, Any, Any, Any],
    sampling: Sampling,
) -> Experience:
    """batch: a RolloutBatch (input_ids, response_start_idx) for left-padded prompts with prompt_mask;
    models: (actor, reference, critic or None, reward). The actor and the critic are put in train mode first, as
    DeepSpeed-Chat does (the hybrid engine swaps its inference kernels back out, and with dropout off the
    log-probs then come from the very function the PPO update differentiates); the frozen reference and
    reward models in eval mode."""
    actor, reference, critic, reward = models
    input_ids = batch.input_ids
    prompt_mask = prompt_mask.to(input_ids.device)
    if prompt_mask.shape[0] != input_ids.shape[0]:  # n_samples_per_prompt > 1: prompts were repeated
        prompt_mask = prompt_mask.repeat_interleave(input_ids.shape[0] // prompt_mask.shape[0], dim=0)
    attention, response = response_masks(input_ids, prompt_mask, batch.response_start_idx, eos_id)
    actor.train()
    reference.eval()
    reward.eval()
    logprobs, ref_logprobs = paired_logprobs(actor, reference, input_ids, attention, response, sampling)
    values = None
    if critic is not None:  # grpo / rloo have none: their baseline is the other responses to the prompt
        critic.train()
        values = score_and_value(critic, input_ids, attention)[0].float()
    _, scores = score_and_value(reward, input_ids, attention)
    return Experience(input_ids, attention, response, logprobs, ref_logprobs, values, scores.float())
