"""PPO losses and diagnostics (Schulman et al. 2017). Shapes: [B, A] over actions; see kubealign.rl."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kubealign.rl.advantages import masked_mean, masked_var


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar: share of response actions where the clipped term was active
    approx_kl: torch.Tensor  # scalar: k3 estimate of KL(old || new), mean over response actions


class ValueLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar


class Sampling(NamedTuple):
    """The sampling settings of a rollout. top_k / top_p shape only what the rollout draws; the log-probs,
    ratios, KL estimates and entropies take the temperature alone (scaled_logits)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables


def scaled_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> the float32 logits every log-prob, ratio, KL and entropy is taken from: divided
    by the sampling temperature and NOT filtered by top-k / top-p, as TRL, OpenRLHF and veRL take them.

    Why unfiltered: the filter recomputed from a full forward does not reproduce the one the KV-cached
    rollout applied once precision is bf16/fp16 (a token at the filter's edge falls outside it: measured
    2 of 4,123 sampled tokens at top_p 0.9), and such a token's filtered log-prob is -inf, which makes the
    KL, the whitened advantages and then the whole batch NaN. Unfiltered log-probs are finite for every
    token; old and new log-probs still come from this one function, so the ratio is exactly 1 before the
    first step, and the KL of a model to itself exactly 0. The cost is the peers' too: with a filter the
    ratio's denominator is the unfiltered probability, not the sampler's (docs/ppo.md)."""
    scores = logits.float()
    if sampling.temperature != 1.0:  # x / 1 == x: no pass over [N, T, V] (and none in autograd) for nothing
        scores = scores / sampling.temperature
    return scores


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits and [B, T] ids -> [B, T-1] log-probability of each next token (the actions).
    Pass scaled_logits(...) for the log-probs at the sampling temperature."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T-1] entropy of the next-token distribution at each action (tokens at -inf
    contribute 0 and no NaN gradient)."""
    return entropy_from_logprobs(F.log_softmax(logits[:, :-1].float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] normalized log-probs -> [...] entropy, -sum p log p (tokens at -inf contribute 0)."""
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, entropy_grad: bool, where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of [B, T, V] logits from ONE log-softmax over the
    vocabulary. entropy_grad False: the entropy is for logging only (entropy_coef 0), computed without
    autograd — the backward pass holds and differentiates nothing the loss does not use — and only at
    the [B, T-1] actions `where` marks, 0 elsewhere (with entropy_grad: at every action)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    logprobs = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return logprobs, entropy_from_logprobs(logp)
    with torch.no_grad():
        entropy = torch.zeros_like(logprobs)
        entropy[where.bool()] = entropy_from_logprobs(logp.detach()[where.bool()])
        return logprobs, entropy


def loss_denominator(response_mask: torch.Tensor, how: str = "token", max_tokens: int = 0) -> float:
    """What `aggregate` divides this minibatch's summed loss by (ppo.loss_aggregation), [B, A] mask:
    token     the response tokens;
    sequence  the responses (rows with at least one response token);
    constant  the rows times max_tokens (Dr. GRPO's fixed length), a row with an empty response included."""
    if how == "token":
        return float(response_mask.sum())
    if how == "sequence":
        return float((response_mask.sum(-1) > 0).sum())
    if how == "constant":
        return float(response_mask.shape[0] * max_tokens)
    raise ValueError(f"unknown loss aggregation {how!r} (expected token, sequence or constant)")


def aggregate(
    per_token: torch.Tensor,
    response_mask: torch.Tensor,
    how: str = "token",
    max_tokens: int = 0,
    denominator: float | None = None,
) -> torch.Tensor:
    """[B, A] per-token loss -> scalar, over the response actions (ppo.loss_aggregation):
    token     sum over every response token / their count (DAPO, TRL's "dapo"): each token weighs the
              same, so a long response weighs more;
    sequence  sum over responses of each response's token mean / their count (DeepSeekMath eq. 3, PPO in
              DeepSpeed-Chat's per-sequence form): each response weighs the same;
    constant  sum over every response token / (rows * max_tokens) (Dr. GRPO, Liu et al. 2025, sec. 3.1):
              no length normalization at all, so no bias towards long wrong or short right answers.
    denominator: the count to divide by (loss_denominator's); None: this minibatch's own. The trainer passes
    the count over every rank's minibatch divided by the number of ranks, so that DeepSpeed's mean of the
    ranks' gradients is the gradient of the sum over every rank's tokens / the global count (DAPO's global
    token mean, not the mean of per-rank means). Rows left out of the loss (drop_equal_reward_groups) are
    not passed at all: they are in no denominator."""
    if denominator is None:
        denominator = loss_denominator(response_mask, how, max_tokens)
    mask = response_mask.to(per_token.dtype)
    if how == "sequence":
        rows = mask.sum(-1)
        total = ((per_token * mask).sum(-1) / rows.clamp(min=1)).sum()  # a row without response tokens adds 0
    elif how in ("token", "constant"):
        total = (per_token * mask).sum()
    else:
        raise ValueError(f"unknown loss aggregation {how!r} (expected token, sequence or constant)")
    return total / (denominator if denominator > 0 else 1.0)  # nothing counted: a zero loss, not 0 / 0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    aggregation: str = "token",
    max_tokens: int = 0,
    denominator: float | None = None,
) -> PolicyLoss:
    """Clipped surrogate: max(-A r, -A clip(r, 1 - eps, 1 + eps_high)) per response action, aggregated
    (`aggregate`), r = exp(logprobs - old_logprobs) (PPO paper eq. 7, as a loss to minimize; eps_high =
    cliprange_high, DAPO's clip-higher, Yu et al. 2025 eq. 10; None = eps). Positions outside the response
    do not matter, even at -inf. clip_fraction and approx_kl are token means whatever the aggregation.
    denominator: see `aggregate`."""
    log_ratio = torch.where(response_mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    high = cliprange if cliprange_high is None else cliprange_high
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + high)
    loss = aggregate(torch.maximum(unclipped, clipped), response_mask, aggregation, max_tokens, denominator)
    clip_fraction = masked_mean((clipped > unclipped).to(logprobs.dtype), response_mask)
    approx_kl = masked_mean((ratio - 1) - log_ratio, response_mask)  # k3: unbiased, always >= 0
    return PolicyLoss(loss, clip_fraction.detach(), approx_kl.detach())


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> ValueLoss:
    """0.5 * mean over response actions of max((V - R)^2, (V_clipped - R)^2), with V_clipped =
    old_V + clip(V - old_V, -eps, eps) (the PPO2 value clipping DeepSpeed-Chat and TRL use)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), response_mask)
    clip_fraction = masked_mean((clipped_error > unclipped_error).to(values.dtype), response_mask)
    return ValueLoss(loss, clip_fraction.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over response actions: 1 = perfect critic, 0 = no better than a constant."""
    return 1 - masked_var(returns - values, response_mask) / masked_var(returns, response_mask).clamp(min=1e-8)
