"""One iteration of the ppo stage: rollout, experience, advantages, then ppo_epochs of clipped policy
updates over minibatches.

ppo: KL-penalized per-token rewards, GAE over the critic's values, and a value update beside each policy
update. grpo / rloo (critic-free): one outcome reward per response, an advantage relative to the other
responses to the same prompt (rl/advantages.py), the same clipped ratio; grpo adds a k3 KL loss term."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from kubealign.config.schema import PPOConfig
from kubealign.errors import UserError
from kubealign.models.value_head import score_and_value
from kubealign.rewards import totals
from kubealign.rl import multiturn
from kubealign.rl.advantages import (
    gae,
    group_std,
    grpo_advantages,
    kl_penalized_rewards,
    masked_mean,
    outcome_advantages,
    rloo_advantages,
    sequence_rewards,
    whiten,
)
from kubealign.rl.correction import mismatch, rollout_weights
from kubealign.rl.experience import Experience, FirstPass, make_experience, make_experience_keeping, policy_logprobs
from kubealign.rl.kl import KLController, k3
from kubealign.rl.losses import (
    PolicyLoss,
    Sampling,
    aggregate,
    explained_variance,
    loss_denominator,
    policy_loss,
    value_loss,
)
from kubealign.rl.rollout import PPOModels, SampledLogprobs, generate  # noqa: F401
from kubealign.training import distributed
from kubealign.training.loop import NonFiniteLoss, check_finite


class UnsupervisedData:
    """Phase-1 (prompt, chosen) sequences for the PPO-ptx term, served micro-batch by micro-batch in a
    fixed cyclic order (a function of the number of batches served, so resume needs no extra state).
    Each rank serves its own slice of every round, so world ranks see world different batches."""

    def __init__(
        self, examples: list[dict[str, list[int]]], batch_size: int, pad_id: int, served: int = 0, rank=0, world=1
    ):
        self.examples, self.batch_size, self.pad_id, self.served = examples, batch_size, pad_id, served
        self.rank, self.world = rank, world

    def next_chunk(self) -> list[dict[str, list[int]]]:
        start = (self.served * self.world + self.rank) * self.batch_size
        self.served += 1
        return [self.examples[(start + i) % len(self.examples)] for i in range(self.batch_size)]

    def loss(self, actor: Any) -> torch.Tensor:
        from kubealign.training.lm import batch_loss, collate

        return batch_loss(actor, collate(self.next_chunk(), self.pad_id), fp32=True).loss


def _minibatches(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    return [order[i : i + size] for i in range(0, n, size)]


class ActorObjective(NamedTuple):
    policy: PolicyLoss
    entropy: torch.Tensor  # mean over the minibatch's response actions
    loss: torch.Tensor  # what the actor's backward takes
    kl: torch.Tensor | None  # grpo: the aggregated k3 KL to the reference (the loss term); else None


def actor_objective(
    actor: Any,
    exp: Experience,
    idx: torch.Tensor,
    advantages: torch.Tensor,
    cfg: PPOConfig,
    kl_coef: float = 0.0,
    first: FirstPass | None = None,
    keep: torch.Tensor | None = None,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> ActorObjective:
    """The actor's loss on minibatch idx. The entropy enters autograd only when the loss uses it
    (entropy_coef > 0); at 0 it is logged from the same log-softmax, without gradient work. grpo adds
    kl_coef * the k3 KL of the current policy to the reference (DeepSeekMath eq. 3), a loss term instead of
    a reward penalty, so the advantages stay purely group-relative; both aggregated by ppo.loss_aggregation.
    first: the experience pass's forward of exactly these rows (idx == first.rows), used instead of running
    it again. keep: [N] the rows the loss counts (drop_equal_reward_groups); None: all. The other rows are
    removed before the loss, as DAPO and veRL remove them: in no sum, no denominator and no entropy mean.
    denominator: the policy loss's and the KL term's (minibatch_denominator); None: this minibatch's own.
    weights: [N, A] the rollout correction's per-token weights of the policy loss (rollout_correction); None: 1."""
    ids, mask, resp = exp.input_ids[idx], exp.attention_mask[idx], exp.response_mask[idx]
    use_entropy = cfg.entropy_coef > 0
    if first is not None:
        logprobs, entropy = first.logprobs, first.entropy
    else:
        logprobs, entropy = policy_logprobs(actor, ids, mask, resp, Sampling.of(cfg), entropy_grad=use_entropy)
    rows = slice(None) if keep is None else keep[idx].bool()
    logprobs, entropy, resp = logprobs[rows], entropy[rows], resp[rows]
    how, most = cfg.loss_aggregation, cfg.max_new_tokens
    pl = policy_loss(
        logprobs,
        exp.logprobs[idx][rows],
        advantages[idx][rows],
        resp,
        cfg.cliprange,
        cfg.cliprange_high,
        how,
        most,
        denominator,
        kind=cfg.policy_loss,
        weights=None if weights is None else weights[idx][rows],
        sapo_temperatures=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg),
    )
    mean_entropy = masked_mean(entropy, resp)
    actor_loss = pl.loss - cfg.entropy_coef * mean_entropy if use_entropy else pl.loss
    kl = None
    if cfg.algorithm == "grpo":
        kl = aggregate(k3(logprobs, exp.ref_logprobs[idx][rows], resp), resp, how, most, denominator)
        actor_loss = actor_loss + kl_coef * kl if kl_coef > 0 else actor_loss
    return ActorObjective(pl, mean_entropy, actor_loss, kl)


def minibatch_denominator(response_mask: torch.Tensor, cfg: PPOConfig) -> float:
    """aggregate's denominator for one step: loss_denominator over every rank's counted rows of the step,
    divided by the number of ranks (DeepSpeed averages the ranks' gradients), so the loss is the global
    token (sequence, constant) mean of DAPO and TRL's "dapo", whatever each rank holds. One all_reduce:
    every rank takes it at every step. 0: no rank has anything to count (update() then skips the step)."""
    local = loss_denominator(response_mask, cfg.loss_aggregation, cfg.max_new_tokens)
    return distributed.all_reduce_sum([local])[0] / distributed.world_size()


def update(
    models: PPOModels,
    exp: Experience,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    cfg: PPOConfig,
    gen: Any,
    unsup: UnsupervisedData | None = None,
    kl_coef: float = 0.0,
    plan: list[torch.Tensor] | None = None,
    first: FirstPass | None = None,
    keep: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """ppo_epochs passes of clipped policy updates (+ value updates for ppo) over shuffled minibatches of
    the whole batch's advantages, computed before (a grpo / rloo group spans minibatches: its advantages
    are fixed already); returns the mean of each loss statistic. kl_coef: grpo's KL loss coefficient.
    plan: the first epoch's minibatches, drawn from gen before the experience pass (iteration); first:
    the experience pass's forwards of plan[0], which its step then uses (make_experience_keeping). keep:
    the rows the policy loss counts (Targets.keep); weights: the rollout correction's (rollout_correction).
    A step where no rank has a row to count (every row dropped, or no response token) and no PPO-ptx term
    is skipped on every rank alike, with no backward and no optimizer step: AdamW would otherwise still move the
    weights by momentum and weight decay. A rank
    with nothing while another has rows takes part with a zero loss (its gradient adds nothing to the
    all-reduce). skipped_steps counts the skipped steps."""
    stats: dict[str, list[float]] = {}
    firsts: dict[str, float] = {}
    skipped = 0
    with_critic = cfg.has_critic
    models.actor.train()  # the hybrid engine leaves inference mode here; dropout is off (disable_dropout)
    if with_critic:
        models.critic.train()
    for epoch in range(cfg.ppo_epochs):
        minibatches = (
            plan if epoch == 0 and plan is not None else _minibatches(exp.input_ids.shape[0], cfg.micro_batch_size, gen)
        )
        for step, idx in enumerate(minibatches):
            ids, mask, resp = exp.input_ids[idx], exp.attention_mask[idx], exp.response_mask[idx]
            counted = resp if keep is None else resp[keep[idx].bool()]
            denominator = minibatch_denominator(counted, cfg)
            if denominator == 0 and unsup is None:
                skipped += 1
                continue
            reused = first if epoch == 0 and step == 0 else None
            pl, mean_entropy, actor_loss, kl = actor_objective(
                models.actor, exp, idx, advantages, cfg, kl_coef, reused, keep, denominator, weights
            )
            if unsup is not None:  # InstructGPT's PPO-ptx: keep the pretraining/SFT distribution (eq. 2, gamma)
                lm = unsup.loss(models.actor)
                actor_loss = actor_loss + cfg.unsup_coef * lm
                stats.setdefault("unsup_loss", []).append(lm.item())
            check_finite({"actor loss": actor_loss})  # before the step: a nan step would poison the weights
            models.actor.backward(actor_loss)
            models.actor.step()
            logged = {
                "policy_loss": pl.loss,
                "clip_fraction": pl.clip_fraction,
                "approx_kl": pl.approx_kl,
                "entropy": mean_entropy,
            }
            if kl is not None:
                logged["kl_loss"] = kl  # the k3 KL before the coefficient
            if with_critic:
                kept = reused.values if reused is not None else None
                values = kept if kept is not None else score_and_value(models.critic, ids, mask)[0]
                vl = value_loss(values.float(), exp.values[idx], returns[idx], resp, cfg.cliprange_value)
                check_finite({"critic loss": vl.loss})
                models.critic.backward(vl.loss)
                models.critic.step()
                logged.update(value_loss=vl.loss, value_clip_fraction=vl.clip_fraction)
            for key, value in logged.items():
                stats.setdefault(key, []).append(value.item())
            if epoch == 0 and step == 0 and first is None:
                # Before the first step the policy is the one that sampled: ratio exactly 1, so both are exactly
                # 0 unless the rollout's log-probs and the training forward disagree (live dropout, kernels,
                # settings). A reused forward is the rollout's: 0 by construction, measuring nothing, not logged.
                firsts = {"approx_kl_first": stats["approx_kl"][0], "clip_fraction_first": stats["clip_fraction"][0]}
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, **firsts, "skipped_steps": float(skipped)}


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


class Targets(NamedTuple):
    advantages: torch.Tensor  # [N, A] what the policy loss weights each response action by
    returns: torch.Tensor | None  # [N, A] the critic's regression target (ppo); None without a critic
    kl: torch.Tensor  # [N, A] per-token KL estimate log pi - log pi_ref (0 outside the response)
    metrics: dict[str, float]  # the algorithm's own per-iteration quantities
    keep: torch.Tensor | None = None  # [N] rows the policy loss counts (drop_equal_reward_groups); None: all


def ppo_targets(exp: Experience, cfg: PPOConfig, beta: float) -> Targets:
    """KL-penalized per-token rewards, GAE over the critic's values, optionally whitened advantages."""
    rewards = kl_penalized_rewards(exp.logprobs, exp.ref_logprobs, exp.scores, exp.response_mask, beta, cfg.reward_clip)
    adv = gae(exp.values, rewards.rewards, exp.response_mask, cfg.gamma, cfg.lam)
    advantages = whiten(adv.advantages, exp.response_mask) if cfg.whiten_advantages else adv.advantages
    ev = float(explained_variance(exp.values, adv.returns, exp.response_mask))
    return Targets(advantages, adv.returns, rewards.kl, {"explained_variance": ev})


def group_targets(exp: Experience, cfg: PPOConfig, beta: float) -> Targets:
    """grpo / rloo: one outcome reward per response (rloo: minus beta * its summed KL; grpo: none, its KL is
    a loss term), advantages relative to the group of cfg.group_size responses to the same prompt — the
    contiguous rows of the rollout — on every response action. Formed here, over the whole batch in rollout
    order, before update() shuffles it into minibatches."""
    k = cfg.group_size
    rloo = cfg.algorithm == "rloo"
    seq = sequence_rewards(
        exp.logprobs, exp.ref_logprobs, exp.scores, exp.response_mask, beta if rloo else 0.0, cfg.reward_clip
    )
    scored = exp.scored  # rows nothing scored join no group statistic and get advantage 0 (None: all scored)
    if rloo:
        advantages = rloo_advantages(seq.rewards, k, scored)
    else:  # the batch's std pools every rank's scored rewards, as TRL gathers them before scaling
        pooled = seq.rewards if scored is None else seq.rewards[scored]
        batch_std = global_stats(pooled)[1] if cfg.scale_rewards == "batch" else 0.0
        advantages = grpo_advantages(seq.rewards, k, scale=cfg.scale_rewards, batch_std=batch_std, scored=scored)
    std = group_std(seq.rewards, k, scored)
    zero = torch.isclose(std, torch.zeros_like(std))  # every response of the prompt got the same reward
    std_sum, zeros, groups = distributed.all_reduce_sum([float(std.sum()), float(zero.sum()), float(std.numel())])
    metrics = {
        "group_reward_std": std_sum / groups,  # mean over groups (every rank's) of the within-group std
        "zero_std_fraction": zeros / groups,  # groups with no learning signal: all their advantages are 0
        "advantage_abs_mean": global_stats(advantages.abs())[0],  # unscored rows count, at 0
    }
    keep = None
    if cfg.drop_equal_reward_groups:
        keep = (~zero).repeat_interleave(k)  # a group's k rows are contiguous
        metrics["groups_dropped"] = zeros
    return Targets(outcome_advantages(advantages, exp.response_mask), None, seq.kl, metrics, keep)


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
    gap = mismatch(exp.logprobs, exp.rollout_logprobs, exp.response_mask)
    out = rollout_weights(exp.logprobs, exp.rollout_logprobs, exp.response_mask, fix.kind, fix.cap, fix.low, fix.high)
    total, count, corrected = distributed.all_reduce_sum([gap.abs_sum, gap.count, float(out.corrected.sum())])
    metrics = {
        "rollout_logprob_diff_mean": total / count if count else 0.0,
        "rollout_logprob_diff_max": distributed.all_reduce_max([gap.abs_max])[0],
    }
    if fix.kind == "none":
        return None, metrics
    return out.weights, {**metrics, "rollout_corrected_fraction": corrected / count if count else 0.0}


class NonFiniteExperience(NonFiniteLoss):
    """The experience an update would train on holds a nan or inf (a reward score, a log-prob, a value):
    the cause of the non-finite loss it would give is known (see ExperienceFault)."""

    def __init__(self, fault: ExperienceFault):
        super().__init__(fault.message)
        self.trained = fault.trained


class ExperienceFault(NamedTuple):
    message: str  # what is not finite, and how often; '' when everything is
    trained: bool  # a model that trains (actor, critic) is among them: diverged, the learning rate is the


def experience_fault(exp: Experience) -> ExperienceFault:
    """Which values the update reads are not finite, counted over every rank (one all_reduce, so every
    rank raises alike). Scores count per response; log-probs and values per response token (what lies
    outside the response is never read)."""
    fields = [
        ("the reward score", "responses", exp.scores, None, False),
        ("the actor's log-prob", "tokens", exp.logprobs, exp.response_mask, True),
        ("the reference's log-prob", "tokens", exp.ref_logprobs, exp.response_mask, False),
    ]
    if exp.values is not None:
        fields.append(("the critic's value", "tokens", exp.values, exp.response_mask, True))
    counts, examples = [], []
    for _, _, x, mask, _ in fields:
        where = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
        bad = ~torch.isfinite(x) & where
        counts += [float(bad.sum()), float(where.sum())]
        examples.append(float(x[bad][0]) if bool(bad.any()) else None)
    summed = distributed.all_reduce_sum(counts)
    faults, trained = [], False
    for (name, unit, _, _, trains), example, bad, total in zip(
        fields, examples, summed[::2], summed[1::2], strict=True
    ):
        if bad:
            value = f" ({example:g})" if example is not None else ""  # another rank's: no example here
            faults.append(f"{name} is not finite{value} for {int(bad)} of {int(total)} {unit}")
            trained = trained or trains
    return ExperienceFault("; ".join(faults), trained)


def pooled_function_means(exp: Experience) -> dict[str, float]:
    """fn/<NAME>: each reward function's mean over every rank's responses of this experience it applied to
    (None rows left out); a function that applied to none is not logged."""
    mine = totals.function_totals(exp.functions or {})
    if not mine:  # the same on every rank (one config): no collective is skipped on one rank only
        return {}
    flat = distributed.all_reduce_sum([x for total, count in mine.values() for x in (total, float(count))])
    return totals.function_means({name: (s, int(c)) for name, s, c in zip(mine, flat[::2], flat[1::2], strict=True)})


def iteration(
    models: PPOModels,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    cfg: PPOConfig,
    kl: KLController,
    gen: Any,
    unsup: UnsupervisedData | None = None,
    rows: Any = None,
) -> tuple[dict[str, float], Experience]:
    """Rollout + update for one batch of prompts (rows: their rewards.scorer.Rows, one per prompt, for reward
    functions); returns (metrics, experience)."""
    started = time.perf_counter()
    recorder = None
    if models.tools is not None:  # turns with tools or an environment: rl.multiturn (its own masks)
        batch = multiturn.rollout(models, prompt_ids, prompt_mask, cfg, models.tools, rows)
    else:
        recorder = SampledLogprobs(Sampling.of(cfg))
        batch = generate(models, prompt_ids, prompt_mask, cfg, recorder)
    generated = time.perf_counter()
    eos = models.tokenizer.eos_token_id
    plan = _minibatches(batch.input_ids.shape[0], cfg.micro_batch_size, gen)  # the first epoch's, as update() drew it
    first = None
    scored = rows.repeat(cfg.group_size) if rows is not None else None  # a prompt's k responses are contiguous
    if cfg.reuse_first_forward != "none":
        both = cfg.reuse_first_forward == "both"
        exp, first = make_experience_keeping(
            batch,
            prompt_mask,
            eos,
            models,
            Sampling.of(cfg),
            plan[0],
            cfg.entropy_coef > 0,
            keep_critic=both,
            scored_rows=scored,
        )
    else:
        exp = make_experience(batch, prompt_mask, eos, models, Sampling.of(cfg), scored)
    exp = exp._replace(rollout_logprobs=recorder.actions(batch) if recorder is not None else None)
    exp = multiturn.with_environment_rewards(exp, getattr(batch, "env_rewards", None))
    experienced = time.perf_counter()
    fault = experience_fault(exp)
    if fault.message:  # before any update: a nan here would poison every weight it reaches
        raise NonFiniteExperience(fault)
    kl_coef = kl.value
    targets = (ppo_targets if cfg.has_critic else group_targets)(exp, cfg, kl_coef)
    weights, mismatch_metrics = rollout_correction(exp, cfg)
    losses = update(
        models, exp, targets.advantages, targets.returns, cfg, gen, unsup, kl_coef, plan, first, targets.keep, weights
    )
    trained = time.perf_counter()
    kl_mean = update_kl(kl, targets.kl.sum(-1))
    # over the responses something scored, as the fn/NAME means: an unscored one's 0 is no reward
    reward_mean, reward_std, _ = global_stats(exp.scores if exp.scored is None else exp.scores[exp.scored])
    tokens = int(exp.attention_mask.sum())
    metrics = {
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "kl": kl_mean,
        "kl_coef": kl_coef,
        **targets.metrics,
        **mismatch_metrics,
        **pooled_function_means(exp),
        **(multiturn.turn_metrics(batch) if models.tools is not None else {}),
        "response_length": float(exp.response_mask.sum(-1).float().mean()),
        "generation_time_s": generated - started,
        "experience_time_s": experienced - generated,
        "training_time_s": trained - experienced,
        "samples_per_s": exp.input_ids.shape[0] / max(trained - started, 1e-9),
        "tokens_per_s": tokens / max(trained - started, 1e-9),
        **losses,
    }
    return metrics, exp
