"""Rollouts -> experience: masks, actor / reference log-probs, critic values, reward scores.

Generation goes through DeepSpeed's rollout API (HybridEngineRollout) on the hybrid-engine paths and
through the module's generate on the plain-engine path; both return prompt (left-padded) + response.
Everything after the first EOS of a response is padding. Log-probs, the reference's included, are of
the temperature-scaled distribution, unfiltered by top-k / top-p (kubealign.rl.losses.scaled_logits: the
peers' convention; finite for every sampled token in any precision), with the LM head and the log-softmax
at the response actions only (kubealign.models.token_logprobs). The actor is in eval mode while
it generates (the hybrid engine's inference kernels) and in train mode for every log-prob pass, with its
dropout disabled, so the PPO ratio is exactly 1 before the first update — DeepSpeed-Chat computes them
with dropout live.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kubealign.models.token_logprobs import Settings, target_logprobs
from kubealign.models.value_head import score_and_value
from kubealign.rewards.scorer import Scorer
from kubealign.rl.losses import Sampling
from kubealign.rl.rollout import PPOModels


class Experience(NamedTuple):
    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T] prompt + response tokens through the first EOS
    response_mask: torch.Tensor  # [N, A] actions that produced response tokens (A = T - 1)
    logprobs: torch.Tensor  # [N, A]
    ref_logprobs: torch.Tensor  # [N, A]
    values: torch.Tensor | None  # [N, A] critic values; None without a critic (grpo, rloo)
    scores: torch.Tensor  # [N] score of each sequence (reward model and / or reward functions: rewards.scorer)
    scored: torch.Tensor | None = None  # [N] bool: something scored it (rewards.scorer.scored_rows); None: all
    functions: dict[str, list[float | None]] | None = None  # each reward function's values (Scores.per_function)
    # [N, A] the log-probs the rollout sampled each response token with (rollout.SampledLogprobs), 0 elsewhere;
    # None: not known (a rollout engine other than generate's sampling loop)
    rollout_logprobs: torch.Tensor | None = None


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


def response_only(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """x on response actions, 0 elsewhere (also where x is not finite)."""
    return torch.where(response_mask.bool(), x, torch.zeros_like(x))


def policy_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    sampling: Sampling,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) [N, A] of the policy at the sampling temperature (scaled_logits) on the
    response actions, 0 elsewhere: one forward serves the experience and the update, with the LM head and
    the log-softmax at the response actions only (models.token_logprobs). entropy_grad False: the entropy
    carries no gradient (logging only)."""
    settings = Settings(temperature=sampling.temperature, entropy=True, entropy_grad=entropy_grad)
    out = target_logprobs(model, input_ids, attention_mask, response_mask, settings)
    return out.logprobs, out.entropy


def model_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, sampling: Sampling
) -> torch.Tensor:
    """[N, A] log-probs of the sampled response tokens at the sampling temperature, 0 elsewhere —
    policy_logprobs without the entropy, for the actor's other rows, the reference or a baseline."""
    return target_logprobs(model, input_ids, attention_mask, response_mask, Settings(sampling.temperature)).logprobs


def paired_logprobs(
    sampler: Any,
    other: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    sampling: Sampling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampler's, other's) log-probs [N, A] of the sampled response tokens, 0 elsewhere, both from the same
    scaled_logits: their difference estimates a finite KL, exactly 0 for two copies of one model."""
    return (
        model_logprobs(sampler, input_ids, attention_mask, response_mask, sampling),
        model_logprobs(other, input_ids, attention_mask, response_mask, sampling),
    )


def sequence_scores(
    reward: Scorer, input_ids: torch.Tensor, attention: torch.Tensor, response: torch.Tensor, rows: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[float | None]]]:
    """([N] float scores, [N] bool scored, each function's values): the Scorer (reward model, functions or
    both) gets the rows the prompts came from."""
    if not isinstance(reward, Scorer):  # one reward path: a bare model would skip the functions silently
        raise TypeError(f"the experience pass scores with a rewards.scorer.Scorer, not {type(reward).__name__}")
    scores, scored, parts = reward.scored(input_ids, attention, response, rows)
    return scores.float(), scored, parts.per_function


def _masks(batch: Any, prompt_mask: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, response_mask) of a rollout batch; a multi-turn batch brings its own
    (rl.multiturn: the observation tokens are no response actions)."""
    if hasattr(batch, "response_mask"):
        return batch.input_ids, batch.attention_mask, batch.response_mask
    input_ids = batch.input_ids
    prompt_mask = prompt_mask.to(input_ids.device)
    if prompt_mask.shape[0] != input_ids.shape[0]:  # n_samples_per_prompt > 1: prompts were repeated
        prompt_mask = prompt_mask.repeat_interleave(input_ids.shape[0] // prompt_mask.shape[0], dim=0)
    attention, response = response_masks(input_ids, prompt_mask, batch.response_start_idx, eos_id)
    return input_ids, attention, response


def _modes(models: PPOModels) -> None:
    models.actor.train()
    models.reference.eval()
    models.reward.eval()
    if models.critic is not None:
        models.critic.train()


@torch.no_grad()
def make_experience(
    batch: Any,
    prompt_mask: torch.Tensor,
    eos_id: int,
    models: PPOModels,
    sampling: Sampling,
    rows: Any = None,
) -> Experience:
    """batch: a RolloutBatch (input_ids, response_start_idx) for left-padded prompts with prompt_mask;
    models: the actor, reference, critic (None: grpo / rloo) and reward (a Scorer) of PPOModels; rows: the
    data.phases.Rows of the responses (what reward functions read). The actor and the critic are put in train
    mode first, as DeepSpeed-Chat does (the hybrid engine swaps its inference kernels back out, and with dropout off the
    log-probs then come from the very function the PPO update differentiates); the frozen reference and
    reward models in eval mode."""
    actor, reference, critic, reward = models.actor, models.reference, models.critic, models.reward
    input_ids, attention, response = _masks(batch, prompt_mask, eos_id)
    _modes(models)
    logprobs, ref_logprobs = paired_logprobs(actor, reference, input_ids, attention, response, sampling)
    values = None
    if critic is not None:  # grpo / rloo have none: their baseline is the other responses to the prompt
        values = score_and_value(critic, input_ids, attention)[0].float()
    read = getattr(batch, "trajectory_mask", response)  # reward functions read a whole trajectory
    scores, scored, functions = sequence_scores(reward, input_ids, attention, read, rows)
    return Experience(input_ids, attention, response, logprobs, ref_logprobs, values, scores, scored, functions)


class FirstPass(NamedTuple):
    """The experience pass's actor (and critic) forwards of the update's first minibatch, with their autograd
    graphs, so that its first step need not run them again (ppo.reuse_first_forward)."""

    rows: torch.Tensor  # [m] the minibatch's rows of the batch, in the minibatch's order
    logprobs: torch.Tensor  # [m, A] policy_logprobs's, with grad
    entropy: torch.Tensor  # [m, A] with grad only when entropy_grad
    values: torch.Tensor | None  # [m, A] the critic's, with grad; None without a critic


def _stack_rows(
    rows: torch.Tensor, kept: torch.Tensor, rest: torch.Tensor, others: torch.Tensor | None
) -> torch.Tensor:
    """[n, ...] with kept's rows at `rows` and others' at `rest` (n = len(rows) + len(rest))."""
    out = kept.new_empty((rows.numel() + rest.numel(), *kept.shape[1:]))
    out[rows] = kept
    if others is not None:
        out[rest] = others
    return out


def make_experience_keeping(
    batch: Any,
    prompt_mask: torch.Tensor,
    eos_id: int,
    models: PPOModels,
    sampling: Sampling,
    rows: torch.Tensor,
    entropy_grad: bool,
    keep_critic: bool = False,
    scored_rows: Any = None,
) -> tuple[Experience, FirstPass]:
    """make_experience, with the actor's forward of the rows `rows` (the update's first minibatch, in its
    order) run with autograd and kept — with keep_critic the critic's too: the very calls the update would
    make, on the same weights and inputs, so its first step's loss and gradients are those of running them
    again (PPO computes the old and the new log-probs of that minibatch from one set of weights). The
    other rows run without autograd. Memory: the frozen models run before the actor's graph is held; a
    kept critic graph is held beside the actor's until the first step — one more graph at the peak."""
    actor, reference, critic, reward = models.actor, models.reference, models.critic, models.reward
    input_ids, attention, response = _masks(batch, prompt_mask, eos_id)
    _modes(models)
    with torch.no_grad():
        read = getattr(batch, "trajectory_mask", response)  # reward functions read a whole trajectory
        scores, scored, functions = sequence_scores(reward, input_ids, attention, read, scored_rows)
        ref_logprobs = model_logprobs(reference, input_ids, attention, response, sampling)
    keep = (input_ids[rows], attention[rows], response[rows])
    rest = torch.ones(input_ids.shape[0], dtype=torch.bool, device=rows.device)
    rest[rows] = False
    rest = rest.nonzero().squeeze(-1)
    others = (input_ids[rest], attention[rest], response[rest]) if rest.numel() else None
    with torch.enable_grad():
        kept_logprobs, kept_entropy = policy_logprobs(actor, *keep, sampling, entropy_grad)
    with torch.no_grad():
        other = model_logprobs(actor, *others, sampling) if others else None
        logprobs = _stack_rows(rows, kept_logprobs.detach(), rest, other)
    values, kept_values = None, None
    if critic is not None and keep_critic:
        with torch.enable_grad():
            kept_values = score_and_value(critic, *keep[:2])[0]
        with torch.no_grad():
            other_values = score_and_value(critic, *others[:2])[0] if others else None
            values = _stack_rows(rows, kept_values.detach(), rest, other_values).float()
    elif critic is not None:
        with torch.no_grad():
            values = score_and_value(critic, input_ids, attention)[0].float()
    exp = Experience(input_ids, attention, response, logprobs, ref_logprobs, values, scores, scored, functions)
    return exp, FirstPass(rows, kept_logprobs, kept_entropy, kept_values)
