"""One iteration of the ppo stage: rollout, experience, targets, then ppo_epochs of policy updates over
minibatches. This file holds the loop alone; the math it calls lives, module-qualified, where it is defined:
targets (advantages, returns, the rollout correction), losses (the policy loss and its surrogates, the value
loss), kl, experience_checks (what stops the loop before an update) and unsupervised (PPO-ptx's data).

ppo: KL-penalized per-token rewards, GAE over the critic's values, and a value update beside each policy
update. grpo / rloo (critic-free): one outcome reward per response, an advantage relative to the other
responses to the same prompt (rl/advantages.py), the same clipped ratio; grpo adds a k3 KL loss term."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from kubealign.config.schema import PPOConfig
from kubealign.models import value_head
from kubealign.rl import advantages, engines, experience, experience_checks, kl, losses, multiturn, rollout, targets
from kubealign.rl.experience import Experience, FirstPass
from kubealign.rl.unsupervised import UnsupervisedData
from kubealign.training import distributed, loop


class UpdateInputs(NamedTuple):
    """What one update() trains on, all formed over the whole batch before it (iteration)."""

    exp: Experience
    advantages: torch.Tensor  # [N, A] what the policy loss weights each response action by (Targets.advantages)
    returns: torch.Tensor | None = None  # [N, A] the critic's regression target (ppo); None without a critic
    keep: torch.Tensor | None = None  # [N] the rows the policy loss counts (Targets.keep); None: all
    weights: torch.Tensor | None = None  # [N, A] the rollout correction's per-token weights; None: 1
    kl_coef: float = 0.0  # grpo's KL loss coefficient (the controller's beta of this iteration)
    unsup: UnsupervisedData | None = None  # PPO-ptx's data; None: no ptx term


class Plan(NamedTuple):
    """How update() draws its minibatches: `gen` shuffles every epoch's, except a first epoch drawn from it
    before the experience pass (iteration), whose first minibatch that pass has already run forward."""

    gen: torch.Generator
    first_epoch: list[torch.Tensor] | None = None  # [micro_batch_size] row indices each; None: draw it
    first: FirstPass | None = None  # the experience pass's forwards of first_epoch[0]; None: run them again


def _minibatches(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    return [order[i : i + size] for i in range(0, n, size)]


class ActorObjective(NamedTuple):
    policy: losses.PolicyLoss
    entropy: torch.Tensor  # mean over the minibatch's response actions
    loss: torch.Tensor  # what the actor's backward takes
    kl: torch.Tensor | None  # grpo: the aggregated k3 KL to the reference (the loss term); else None


def actor_objective(
    actor: Any,
    inputs: UpdateInputs,
    idx: torch.Tensor,
    cfg: PPOConfig,
    settings: losses.PolicyLossSettings,
    first: FirstPass | None = None,
    denominator: float | None = None,
) -> ActorObjective:
    """The actor's loss on minibatch idx ([n] row indices). The entropy enters autograd only when the loss uses
    it (entropy_coef > 0); at 0 it is logged from the same log-softmax, without gradient work. grpo adds
    kl_coef * the k3 KL of the current policy to the reference (DeepSeekMath eq. 3), a loss term instead of
    a reward penalty, so the advantages stay purely group-relative; both aggregated by settings.aggregation.
    first: the experience pass's forward of exactly these rows (idx == first.rows), used instead of running
    it again. inputs.keep: the rows the loss counts; the other rows are removed before the loss, as DAPO and
    veRL remove them: in no sum, no denominator and no entropy mean. denominator: the policy loss's and the
    KL term's (minibatch_denominator); None: this minibatch's own. inputs.weights: the rollout correction's."""
    exp = inputs.exp
    ids, mask, resp = exp.input_ids[idx], exp.attention_mask[idx], exp.response_mask[idx]
    use_entropy = cfg.entropy_coef > 0
    if first is not None:
        logprobs, entropy = first.logprobs, first.entropy
    else:
        sampling = losses.Sampling.of(cfg)
        logprobs, entropy = experience.policy_logprobs(actor, ids, mask, resp, sampling, entropy_grad=use_entropy)
    rows = slice(None) if inputs.keep is None else inputs.keep[idx].bool()
    logprobs, entropy, resp = logprobs[rows], entropy[rows], resp[rows]
    pl = losses.policy_loss(
        logprobs,
        exp.logprobs[idx][rows],
        inputs.advantages[idx][rows],
        resp,
        settings,
        denominator=denominator,
        weights=None if inputs.weights is None else inputs.weights[idx][rows],
    )
    mean_entropy = advantages.masked_mean(entropy, resp)
    actor_loss = pl.loss - cfg.entropy_coef * mean_entropy if use_entropy else pl.loss
    kl_term = None
    if cfg.algorithm == "grpo":
        k3 = kl.k3(logprobs, exp.ref_logprobs[idx][rows], resp)
        kl_term = losses.aggregate(k3, resp, settings.aggregation, settings.max_tokens, denominator)
        actor_loss = actor_loss + inputs.kl_coef * kl_term if inputs.kl_coef > 0 else actor_loss
    return ActorObjective(pl, mean_entropy, actor_loss, kl_term)


def minibatch_denominator(response_mask: torch.Tensor, settings: losses.PolicyLossSettings) -> float:
    """aggregate's denominator for one step: loss_denominator over every rank's counted rows of the step,
    divided by the number of ranks (DeepSpeed averages the ranks' gradients), so the loss is the global
    token (sequence, constant) mean of DAPO and TRL's "dapo", whatever each rank holds. One all_reduce:
    every rank takes it at every step. 0: no rank has anything to count (update() then skips the step)."""
    local = losses.loss_denominator(response_mask, settings.aggregation, settings.max_tokens)
    return distributed.all_reduce_sum([local])[0] / distributed.world_size()


def update(
    models: rollout.PPOModels,
    inputs: UpdateInputs,
    cfg: PPOConfig,
    settings: losses.PolicyLossSettings,
    plan: Plan,
) -> dict[str, float]:
    """ppo_epochs passes of policy updates (+ value updates for ppo) over shuffled minibatches of the whole
    batch's advantages, computed before (a grpo / rloo group spans minibatches: its advantages are fixed
    already); returns the mean of each loss statistic. A step where no rank has a row to count (every row
    dropped, or no response token) and no PPO-ptx term is skipped on every rank alike, with no backward and
    no optimizer step: AdamW would otherwise still move the weights by momentum and weight decay. A rank
    with nothing while another has rows takes part with a zero loss (its gradient adds nothing to the
    all-reduce). skipped_steps counts the skipped steps."""
    exp, unsup = inputs.exp, inputs.unsup
    stats: dict[str, list[float]] = {}
    firsts: dict[str, float] = {}
    skipped = 0
    with_critic = cfg.has_critic
    models.actor.train()  # the hybrid engine leaves inference mode here; dropout is off (disable_dropout)
    if with_critic:
        models.critic.train()
    for epoch in range(cfg.ppo_epochs):
        minibatches = plan.first_epoch if epoch == 0 and plan.first_epoch is not None else None
        if minibatches is None:
            minibatches = _minibatches(exp.input_ids.shape[0], cfg.micro_batch_size, plan.gen)
        for step, idx in enumerate(minibatches):
            ids, mask, resp = exp.input_ids[idx], exp.attention_mask[idx], exp.response_mask[idx]
            counted = resp if inputs.keep is None else resp[inputs.keep[idx].bool()]
            denominator = minibatch_denominator(counted, settings)
            if denominator == 0 and unsup is None:
                skipped += 1
                continue
            reused = plan.first if epoch == 0 and step == 0 else None
            pl, mean_entropy, actor_loss, kl_term = actor_objective(
                models.actor, inputs, idx, cfg, settings, reused, denominator
            )
            if unsup is not None:  # InstructGPT's PPO-ptx: keep the pretraining/SFT distribution (eq. 2, gamma)
                lm = unsup.loss(models.actor)
                actor_loss = actor_loss + cfg.unsup_coef * lm
                stats.setdefault("unsup_loss", []).append(lm.item())
            loop.check_finite({"actor loss": actor_loss})  # before the step: a nan step would poison the weights
            models.actor.backward(actor_loss)
            models.actor.step()
            logged = {
                "policy_loss": pl.loss,
                "clip_fraction": pl.clip_fraction,
                "approx_kl": pl.approx_kl,
                "entropy": mean_entropy,
            }
            if kl_term is not None:
                logged["kl_loss"] = kl_term  # the k3 KL before the coefficient
            if with_critic:
                kept = reused.values if reused is not None else None
                values = kept if kept is not None else value_head.score_and_value(models.critic, ids, mask)[0]
                vl = losses.value_loss(values.float(), exp.values[idx], inputs.returns[idx], resp, cfg.cliprange_value)
                loop.check_finite({"critic loss": vl.loss})
                models.critic.backward(vl.loss)
                models.critic.step()
                logged.update(value_loss=vl.loss, value_clip_fraction=vl.clip_fraction)
            for key, value in logged.items():
                stats.setdefault(key, []).append(value.item())
            if epoch == 0 and step == 0 and plan.first is None:
                # Before the first step the policy is the one that sampled: ratio exactly 1, so both are exactly
                # 0 unless the rollout's log-probs and the training forward disagree (live dropout, kernels,
                # settings). A reused forward is the rollout's: 0 by construction, measuring nothing, not logged.
                firsts = {"approx_kl_first": stats["approx_kl"][0], "clip_fraction_first": stats["clip_fraction"][0]}
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, **firsts, "skipped_steps": float(skipped)}


def experience_of(
    models: rollout.PPOModels,
    batch: Any,
    prompt_mask: torch.Tensor,
    cfg: PPOConfig,
    first_rows: torch.Tensor,
    rows: Any,
) -> tuple[Experience, FirstPass | None]:
    """The experience pass over a rollout batch, keeping its forwards of first_rows (the first minibatch) for
    update() when ppo.reuse_first_forward asks for it (make_experience_keeping). rows: the prompts'
    rewards.scorer.Rows (None without reward functions)."""
    eos = models.tokenizer.eos_token_id
    scored = rows.repeat(cfg.group_size) if rows is not None else None  # a prompt's k responses are contiguous
    if cfg.reuse_first_forward == "none":
        return experience.make_experience(batch, prompt_mask, eos, models, losses.Sampling.of(cfg), scored), None
    return experience.make_experience_keeping(
        batch,
        prompt_mask,
        eos,
        models,
        losses.Sampling.of(cfg),
        first_rows,
        cfg.entropy_coef > 0,
        keep_critic=cfg.reuse_first_forward == "both",
        scored_rows=scored,
    )


def iteration(
    models: rollout.PPOModels,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    cfg: PPOConfig,
    controller: kl.KLController,
    gen: Any,
    unsup: UnsupervisedData | None = None,
    rows: Any = None,
) -> tuple[dict[str, float], Experience]:
    """Rollout + update for one batch of prompts ([n, P] ids and mask; rows: their rewards.scorer.Rows, one per
    prompt, for reward functions); returns (metrics, experience). controller: the KL coefficient's, adapted
    here to the iteration's KL; gen: the minibatch shuffle's generator."""
    settings = losses.PolicyLossSettings.of(cfg)  # what the policy loss reads, once for every minibatch
    started = time.perf_counter()
    recorder = None
    with engines.awake(models):
        if models.tools is not None:  # turns with tools or an environment: rl.multiturn (its own masks)
            batch = multiturn.rollout(models, prompt_ids, prompt_mask, cfg, models.tools, rows)
        else:
            recorder = rollout.SampledLogprobs(losses.Sampling.of(cfg))
            batch = rollout.generate(models, prompt_ids, prompt_mask, cfg, recorder)
    generated = time.perf_counter()
    first_epoch = _minibatches(batch.input_ids.shape[0], cfg.micro_batch_size, gen)  # as update() would draw it
    exp, first = experience_of(models, batch, prompt_mask, cfg, first_epoch[0], rows)
    exp = exp._replace(rollout_logprobs=recorder.actions(batch) if recorder is not None else None)
    exp = multiturn.with_environment_rewards(exp, getattr(batch, "env_rewards", None))
    experienced = time.perf_counter()
    fault = experience_checks.experience_fault(exp)
    if fault.message:  # before any update: a nan here would poison every weight it reaches
        raise experience_checks.NonFiniteExperience(fault)
    kl_coef = controller.value
    target = (targets.ppo_targets if cfg.has_critic else targets.group_targets)(exp, cfg, kl_coef)
    weights, mismatch_metrics = targets.rollout_correction(exp, cfg)
    targets.check_mismatch(mismatch_metrics, cfg, models.engine)
    inputs = UpdateInputs(exp, target.advantages, target.returns, target.keep, weights, kl_coef, unsup)
    update_stats = update(models, inputs, cfg, settings, Plan(gen, first_epoch, first))
    trained = time.perf_counter()
    kl_mean = targets.update_kl(controller, target.kl.sum(-1))
    # over the responses something scored, as the fn/NAME means: an unscored one's 0 is no reward
    reward_mean, reward_std, _ = targets.global_stats(exp.scores if exp.scored is None else exp.scores[exp.scored])
    tokens = int(exp.attention_mask.sum())
    metrics = {
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "kl": kl_mean,
        "kl_coef": kl_coef,
        **target.metrics,
        **mismatch_metrics,
        **experience_checks.pooled_function_means(exp),
        **(multiturn.turn_metrics(batch) if models.tools is not None else {}),
        "response_length": float(exp.response_mask.sum(-1).float().mean()),
        "generation_time_s": generated - started,
        "experience_time_s": experienced - generated,
        "training_time_s": trained - experienced,
        "generation_share": (generated - started) / max(trained - started, 1e-9),
        "samples_per_s": exp.input_ids.shape[0] / max(trained - started, 1e-9),
        "tokens_per_s": tokens / max(trained - started, 1e-9),
        **update_stats,
    }
    return metrics, exp
