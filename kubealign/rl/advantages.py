"""Per-token rewards with a KL penalty, GAE advantages and returns, whitening.

Shapes: B = batch, A = action positions (sequence length - 1); see kubealign.rl.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rewards(NamedTuple):
    rewards: torch.Tensor  # [B, A] per-token reward: -beta * KL, plus the clipped score at the last action
    kl: torch.Tensor  # [B, A] per-token KL estimate logprobs - ref_logprobs (0 outside the response)


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [B, A] (0 outside the response)
    returns: torch.Tensor  # [B, A] advantages + values (the critic's regression target)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (scalar)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of x over the masked positions (scalar)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalize x to unit variance (and zero mean if shift_mean) over the masked positions; masked-out
    positions come back as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def last_action_index(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last response action."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (response_mask.long() * positions).argmax(-1)


def kl_penalized_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    reward_clip: float,
) -> Rewards:
    """r_t = -beta * (log pi(a_t) - log pi_ref(a_t)) on response actions, plus clip(score, -c, c) at
    the last response action (InstructGPT eq. 2; DeepSpeed-Chat's compute_rewards). scores: [B]."""
    kl = torch.where(response_mask.bool(), logprobs - ref_logprobs, torch.zeros_like(logprobs))
    rewards = -kl_coef * kl
    last = last_action_index(response_mask)
    clipped = scores.to(rewards.dtype).clamp(-reward_clip, reward_clip)
    rewards = rewards.scatter_add(1, last.unsqueeze(1), clipped.unsqueeze(1))
    return Rewards(rewards, kl)


def gae(
    values: torch.Tensor, rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> Advantages:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 16), backwards over the actions:

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},

    where V_{t+1} and A_{t+1} count only if action t+1 is a response action (the episode ends after
    the last response token, and prompt/padding positions are not steps of it). Returns = A + V."""
    mask = response_mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    # Columns before the first response action of any row are prompt for every row: all 0, nothing to loop.
    columns = response_mask.bool().any(0)
    first = int(columns.int().argmax()) if bool(columns.any()) else values.shape[1]
    for t in reversed(range(first, values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        current = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = current
        # A position outside the response passes nothing back: it is no step of the episode.
        next_value = torch.where(mask[:, t] > 0, values[:, t], torch.zeros_like(next_value))
        next_advantage = torch.where(mask[:, t] > 0, current, torch.zeros_like(next_advantage))
    return Advantages(advantages, (advantages + values) * mask)
