"""Per-token rewards with a KL penalty, GAE advantages and returns, whitening; and the critic-free
outcome advantages of GRPO and RLOO, computed within groups of responses to the same prompt.

Shapes: B = batch, A = action positions (sequence length - 1); see kubealign.rl. For GRPO / RLOO the batch
is N = G * k responses, G prompts with k samples each, a prompt's k samples CONTIGUOUS (rows g*k .. g*k+k-1),
the order in which the rollout repeats each prompt (repeat_interleave, as HF generate's
num_return_sequences does).
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

    where t + 1 is the next response action after t: positions that are no response action — the prompt, the
    padding, and in a multi-turn trajectory the observation tokens between two turns (rl.multiturn) — are
    no steps of the episode and are skipped, so a turn's last token bootstraps from the next turn's first;
    after the last response action the episode ends (V and A of what follows are 0). Returns = A + V."""
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
        # A position outside the response is no step of the episode: it passes the next step's V and A on
        # unchanged (0 after the last response action, where the loop starts with nothing to pass on).
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_advantage = torch.where(mask[:, t] > 0, current, next_advantage)
    return Advantages(advantages, (advantages + values) * mask)


# GRPO's std in the denominator: + eps keeps a group whose rewards are all equal at advantage 0 (its
# numerator is exactly 0) instead of 0/0. 1e-4 is TRL's GRPOTrainer value.
GRPO_EPS = 1e-4


class SequenceRewards(NamedTuple):
    rewards: torch.Tensor  # [B] one reward per response: clipped score - beta * summed KL
    kl: torch.Tensor  # [B, A] per-token KL estimate logprobs - ref_logprobs (0 outside the response)


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G * k] -> [G, k]: row g holds the k contiguous responses of prompt g."""
    if group_size < 2 or x.shape[0] % group_size:  # one response has nothing to be relative to
        raise ValueError(f"{x.shape[0]} responses do not make groups of {group_size} (at least 2 each)")
    return x.reshape(-1, group_size)


def sequence_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    reward_clip: float,
) -> SequenceRewards:
    """R = clip(score, -c, c) - beta * sum_t (log pi(a_t) - log pi_ref(a_t)) over the response: the KL
    penalty of kl_penalized_rewards summed into one outcome reward, as TRL's RLOOTrainer folds it in
    (Ahmadian et al. 2024 sec. 3). GRPO passes kl_coef 0: its KL is a loss term (kl.k3)."""
    kl = torch.where(response_mask.bool(), logprobs - ref_logprobs, torch.zeros_like(logprobs))
    clipped = scores.to(kl.dtype).clamp(-reward_clip, reward_clip)
    return SequenceRewards(clipped - kl_coef * kl.sum(-1), kl)


class GroupStats(NamedTuple):
    mean: torch.Tensor  # [G, 1] mean of each group's scored rewards
    std: torch.Tensor  # [G, 1] their unbiased std (divisor n - 1); 0 for a group with fewer than 2 scored
    count: torch.Tensor  # [G, 1] how many of the group's responses were scored
    valid: torch.Tensor  # [G, k] 1 for a scored response, else 0 (reward dtype)


def group_stats(rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> GroupStats:
    """[G * k] rewards, [G * k] scored (bool; None: all) -> each group's statistics over its scored responses
    only. An unscored response (every reward function returned None for it, and no reward model: TRL's
    convention since 2026-06) is no evidence about the prompt: it joins no mean, std or baseline."""
    g = grouped(rewards, group_size)
    valid = torch.ones_like(g) if scored is None else grouped(scored, group_size).to(g.dtype)
    count = valid.sum(-1, keepdim=True)
    mean = (g * valid).sum(-1, keepdim=True) / count.clamp(min=1)
    var = (((g - mean) * valid) ** 2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    return GroupStats(mean, var.sqrt(), count, valid)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = GRPO_EPS,
    scale: str = "group",
    batch_std: float | None = None,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """[G * k] -> [G * k]: A_i = (R_i - mean_g R) / s, centred on each prompt's group (ppo.scale_rewards):
      group  s = std_g R + eps, the group's own (Shao et al. 2024, DeepSeekMath sec. 4.1.2);
      batch  s = batch_std + eps, one std of every scored response's reward in the batch, every rank's (TRL's
             scale_rewards="batch": a group with a tiny spread is not blown up to unit scale; None:
             the std of this rank's scored rewards);
      none   s = 1 (Dr. GRPO, Liu et al. 2025: the std division biases towards groups that are too easy or
             too hard).
    std is the unbiased one (divisor k - 1), as TRL, OpenRLHF and veRL compute it. scored: [G * k] bool,
    None = all; mean and std are over the scored responses, and an unscored one gets advantage 0."""
    stats = group_stats(rewards, group_size, scored)
    centered = (grouped(rewards, group_size) - stats.mean) * stats.valid
    if scale == "group":
        return (centered / (stats.std + eps)).reshape(-1)
    if scale == "batch":
        if batch_std is None:
            kept = rewards if scored is None else rewards[scored.bool()]
            batch_std = float(kept.std()) if kept.numel() > 1 else 0.0
        return (centered / (batch_std + eps)).reshape(-1)
    if scale == "none":
        return centered.reshape(-1)
    raise ValueError(f"unknown scale_rewards {scale!r} (expected group, batch or none)")


def rloo_advantages(rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[G * k] -> [G * k]: A_i = R_i - mean_{j != i} R_j, the leave-one-out baseline (Kool et al. 2019;
    Ahmadian et al. 2024, eq. 6) = n / (n - 1) * (R_i - mean_g R) over the group's n scored responses
    (scored: [G * k] bool, None = all). An unscored response, and the only scored one of its group, get 0."""
    stats = group_stats(rewards, group_size, scored)
    g = grouped(rewards, group_size)
    others = stats.count - 1
    baseline = ((g * stats.valid).sum(-1, keepdim=True) - g) / others.clamp(min=1)
    return ((g - baseline) * stats.valid * (others > 0).to(g.dtype)).reshape(-1)


def group_std(rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """[G * k] -> [G] unbiased std of each group's scored rewards (0: the group carries no learning signal,
    fewer than two scored responses included)."""
    return group_stats(rewards, group_size, scored).std.squeeze(-1)


def outcome_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence advantages -> [B, A]: the same advantage at every response action of the row, 0 outside
    (an outcome reward credits every token of the response alike)."""
    return advantages.unsqueeze(1) * response_mask.to(advantages.dtype)
