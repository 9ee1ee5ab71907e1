"""What an update trains towards, formed from one iteration's experience before the update shuffles it into
minibatches: ppo's KL-penalized rewards and GAE advantages and returns (ppo_targets), grpo's and rloo's
group-relative advantages (group_targets), the rollout correction's per-token weights of the policy loss
(rollout_correction), and the pooled statistics that make these and the KL controller describe every rank's
batch rather than this rank's share of it (global_stats, update_kl). Shapes: [N, A] over actions; see
kubealign.rl."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kubealign.config.schema import PPOConfig
from kubealign.errors import UserError
from kubealign.rl import advantages, correction, losses
from kubealign.rl.experience import Experience
from kubealign.rl.kl import KLController
from kubealign.training import distributed


class Targets(NamedTuple):
    advantages: torch.Tensor  # [N, A] what the policy loss weights each response action by
    returns: torch.Tensor | None  # [N, A] the critic's regression target (ppo); None without a critic
    kl: torch.Tensor  # [N, A] per-token KL estimate log pi - log pi_ref (0 outside the response)
    metrics: dict[str, float]  # the algorithm's own per-iteration quantities
    keep: torch.Tensor | None = None  # [N] rows the policy loss counts (drop_equal_reward_groups); None: all


def global_stats(values: torch.Tensor) -> tuple[float, float, int]:
    """(mean, unbiased std, count) of `values` pooled over every rank's, so that what is logged and what
    the KL controller sees describe the whole batch, not rank 0's share of it."""
    total, squares, count = distributed.all_reduce_sum(
        [float(values.sum()), float((values.double() ** 2).sum()), float(values.numel())]
    )
    mean = total / count if count else float("nan")  # nothing to average (every response unscored)
    variance = (squares - count * mean**2) / (count - 1) if count > 1 else 0.0
    return mean, max(variance, 0.0) ** 0.5, int(count)


def update_kl(kl: KLController, seq_kl: torch.Tensor) -> float:
    """Adapt beta to the mean sequence KL of every rank's samples ([N] here): each rank then keeps the
    same beta, and rank 0's, the one a checkpoint saves, is everyone's. Returns that mean KL."""
    mean, _, count = global_stats(seq_kl)
    kl.update(mean, count)
    return mean


def ppo_targets(exp: Experience, cfg: PPOConfig, beta: float) -> Targets:
    """KL-penalized per-token rewards, GAE over the critic's values, optionally whitened advantages."""
    rewards = advantages.kl_penalized_rewards(
        exp.logprobs, exp.ref_logprobs, exp.scores, exp.response_mask, beta, cfg.reward_clip
    )
    adv = advantages.gae(exp.values, rewards.rewards, exp.response_mask, cfg.gamma, cfg.lam)
    whitened = advantages.whiten(adv.advantages, exp.response_mask) if cfg.whiten_advantages else adv.advantages
    ev = float(losses.explained_variance(exp.values, adv.returns, exp.response_mask))
    return Targets(whitened, adv.returns, rewards.kl, {"explained_variance": ev})


def group_targets(exp: Experience, cfg: PPOConfig, beta: float) -> Targets:
    """grpo / rloo: one outcome reward per response (rloo: minus beta * its summed KL; grpo: none, its KL is
    a loss term), advantages relative to the group of cfg.group_size responses to the same prompt — the
    contiguous rows of the rollout — on every response action. Formed here, over the whole batch in rollout
    order, before update() shuffles it into minibatches."""
    k = cfg.group_size
    rloo = cfg.algorithm == "rloo"
    seq = advantages.sequence_rewards(
        exp.logprobs, exp.ref_logprobs, exp.scores, exp.response_mask, beta if rloo else 0.0, cfg.reward_clip
    )
    scored = exp.scored  # rows nothing scored join no group statistic and get advantage 0 (None: all scored)
    if rloo:
        relative = advantages.rloo_advantages(seq.rewards, k, scored)
    else:  # the batch's std pools every rank's scored rewards, as TRL gathers them before scaling
        pooled = seq.rewards if scored is None else seq.rewards[scored]
        batch_std = global_stats(pooled)[1] if cfg.scale_rewards == "batch" else 0.0
        relative = advantages.grpo_advantages(
            seq.rewards, k, scale=cfg.scale_rewards, batch_std=batch_std, scored=scored
        )
    std = advantages.group_std(seq.rewards, k, scored)
    zero = torch.isclose(std, torch.zeros_like(std))  # every response of the prompt got the same reward
    std_sum, zeros, groups = distributed.all_reduce_sum([float(std.sum()), float(zero.sum()), float(std.numel())])
    metrics = {
        "group_reward_std": std_sum / groups,  # mean over groups (every rank's) of the within-group std
        "zero_std_fraction": zeros / groups,  # groups with no learning signal: all their advantages are 0
        "advantage_abs_mean": global_stats(relative.abs())[0],  # unscored rows count, at 0
    }
    keep = None
    if cfg.drop_equal_reward_groups:
        keep = (~zero).repeat_interleave(k)  # a group's k rows are contiguous
        metrics["groups_dropped"] = zeros
    return Targets(advantages.outcome_advantages(relative, exp.response_mask), None, seq.kl, metrics, keep)


def rollout_correction(exp: Experience, cfg: PPOConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(the policy loss's per-token weights of ppo.rollout_correction, None for none; metrics). The metrics pool
    every rank's response tokens: rollout_logprob_diff_mean / _max, the mean and max |log pi_trainer - log
    pi_rollout| before the first update (exp.logprobs is the trainer's then; 0 when the rollout computes
    exactly what the trainer does), and with a correction rollout_corrected_fraction, the share of tokens
    whose weight it changed. No rollout log-probs (another rollout engine): nothing to log, and a correction
    asked for is refused rather than silently skipped."""
    fix = cfg.rollout_correction
    if exp.rollout_logprobs is None:
        if fix.kind != "none":
            raise UserError(
                f"ppo.rollout_correction.kind={fix.kind} needs the rollout's log-probs, which this rollout engine "
                "does not report (it bypasses generate's sampling loop); set ppo.rollout_correction.kind=none"
            )
        return None, {}
    gap = correction.mismatch(exp.logprobs, exp.rollout_logprobs, exp.response_mask)
    out = correction.rollout_weights(
        exp.logprobs, exp.rollout_logprobs, exp.response_mask, fix.kind, fix.cap, fix.low, fix.high
    )
    total, count, corrected = distributed.all_reduce_sum([gap.abs_sum, gap.count, float(out.corrected.sum())])
    metrics = {
        "rollout_logprob_diff_mean": total / count if count else 0.0,
        "rollout_logprob_diff_max": distributed.all_reduce_max([gap.abs_max])[0],
    }
    if fix.kind == "none":
        return None, metrics
    return out.weights, {**metrics, "rollout_corrected_fraction": corrected / count if count else 0.0}


def check_mismatch(metrics: dict[str, float], cfg: PPOConfig, engine: str) -> None:
    """Stop before the update when the rollout's log-probs are further from the trainer's than the bound (mean
    |difference| over every rank's response tokens, nats; ppo.rollout.max_logprob_diff): the engine then samples
    from other weights (a weight load that did not happen) or another distribution, and the update would be off
    policy by more than any correction is meant to repair. The mean is pooled, so every rank stops alike. Not
    with a top-k / top-p filter: the rollout's log-probs are then of the filtered distribution and the trainer's
    of the whole one (losses.scaled_logits), so their difference measures the filter, whatever the engine."""
    bound = cfg.rollout.bound(engine)
    gap = metrics.get("rollout_logprob_diff_mean")
    if bound is None or gap is None or gap <= bound or cfg.top_k != 0 or cfg.top_p < 1.0:
        return
    raise UserError(
        f"the {engine} rollout engine's log-probs differ from the trainer's by {gap:.4g} nats (mean over response "
        f"tokens), more than ppo.rollout.max_logprob_diff {bound:g}: stopped before this iteration's update "
        "(ppo.rollout.engine hf generates with the trainer's own forward)"
    )
