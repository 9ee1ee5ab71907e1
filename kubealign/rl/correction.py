"""Rollout-trainer mismatch: how far the log-probs the rollout sampled with are from the trainer's own, and the
correction of the policy loss for it (ppo.rollout_correction). Shapes: [B, A] over actions; see kubealign.rl.

The trainer's log-probs of the rollout's tokens (the experience pass, before any update) are the PPO ratio's
denominator; the tokens were drawn from the rollout's distribution, which differs from them when generation
runs other kernels (the hybrid engine's inference containers), another precision (bf16), or a top-k / top-p
filter (the trainer's log-probs are unfiltered: losses.scaled_logits). Then the "on-policy" update is off
policy, and w = pi_trainer / pi_rollout per token is the importance weight that makes it on policy again
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; TRL's
vllm_importance_sampling_correction, veRL's rollout_is / rollout_rs)."""

from __future__ import annotations

from typing import NamedTuple

import torch

# ppo.rollout_correction.kind
CORRECTIONS = ("none", "tis", "mask")


class Mismatch(NamedTuple):
    """|log pi_trainer - log pi_rollout| over the response actions, as sums for pooling over ranks."""

    abs_sum: float  # sum over response actions
    abs_max: float  # max over response actions (0 with none)
    count: float  # response actions


def mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor) -> Mismatch:
    """The step-0 mismatch of one rank's batch: exactly 0 when both log-probs come from one computation."""
    where = response_mask.bool()
    diff = (trainer_logprobs.double() - rollout_logprobs.double()).abs()[where]
    return Mismatch(float(diff.sum()), float(diff.max()) if diff.numel() else 0.0, float(diff.numel()))


class Correction(NamedTuple):
    weights: torch.Tensor  # [B, A] what each action's policy loss is multiplied by (held constant); 1 outside
    corrected: torch.Tensor  # [B, A] bool: response actions whose weight the cap or the bounds changed


def rollout_weights(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Per-token weights from w = exp(trainer - rollout):
    none  1 everywhere;
    tis   min(w, cap): truncated importance sampling (Ionides 2008; Yao et al. 2025): unbiased where w <= cap,
          and no token's weight, hence no gradient, can blow up where the rollout's probability was tiny;
    mask  1 where low <= w <= high, else 0: a token whose two probabilities disagree that much is left out
          of the loss (TRL's token_mask, veRL's token rejection sampling) instead of reweighted.
    The weights count in the numerator only: the loss's denominator (aggregate) stays the tokens' count, as
    TRL and veRL keep it, so a masked token lowers the loss rather than reweighting the rest."""
    where = response_mask.bool()
    ratio = torch.where(where, trainer_logprobs - rollout_logprobs, torch.zeros_like(trainer_logprobs)).exp()
    if kind == "none":
        return Correction(torch.ones_like(ratio), torch.zeros_like(where))
    if kind == "tis":
        return Correction(ratio.clamp(max=cap), (ratio > cap) & where)
    if kind == "mask":
        inside = (ratio >= low) & (ratio <= high)
        return Correction(inside.to(ratio.dtype), ~inside & where)
    raise ValueError(f"unknown rollout correction {kind!r} (expected one of {', '.join(CORRECTIONS)})")
