"""Stage 3, ppo: the four-model RLHF engine — actor (DeepSpeed Hybrid Engine when the preflight allows),
frozen reference, critic (from the RM dir, per-token values) and frozen reward (sequence score).
ppo.algorithm grpo / rloo run the same stage critic-free: three models, no critic is loaded.
The score of a response comes from a rewards.scorer.Scorer: the reward model, the configured reward
functions (rewards.functions, run in a worker process), or both, weighted. With functions and
rewards.model_weight 0 no reward model is loaded at all, and ppo's critic starts from the SFT model with
a new value head (DeepSpeed-Chat starts it from the reward model, which there is none of).

Output (atomic) in --output DIR: the actor as a self-contained HF dir (adapters merged), DIR/critic (ppo
only), DIR/ema (when ppo.ema_coef is set) and result.json: the algorithm, reward and KL on the phase-3
eval prompts before and after training, the per-iteration history, the effective rollout path and the
time split.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch

from kubealign.cluster import progress
from kubealign.config import KubealignConfig
from kubealign.config.schema import PPOConfig
from kubealign.data import batching, phases
from kubealign.data.phases import Rows
from kubealign.data.tokenize import cut_left, encode_prompt, pad_batch
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, write_result
from kubealign.provenance.manifest import environment
from kubealign.rewards.totals import function_means, function_totals
from kubealign.rl import engines, experience, experience_checks, kl, losses, memory, multiturn, rollout, unsupervised
from kubealign.rl.iteration import iteration
from kubealign.stages import ppo_models, ppo_state
from kubealign.tracking.lineage import phase_ref
from kubealign.tracking.runs import stage_run
from kubealign.training import checkpoints, distributed, export, preemption
from kubealign.training.loop import NonFiniteLoss, checkpoint_note, fault_hook, nonfinite
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner

STAGE = "ppo"


def encode_prompts(rows: Any, tokenizer: Any, max_len: int) -> list[list[int]]:
    """Phase-3 prompts, cut from the left to max_len tokens (the end of a dialogue matters most; a leading
    BOS stays)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [cut_left(encode_prompt(tokenizer, p), max_len, bos) for p in dict.fromkeys(rows["prompt"])]


def prompt_order(lengths: list[int], step: int, cfg: PPOConfig, rank: int, world: int) -> list[int]:
    """Indices of the prompts of iteration `step` for this rank: the step's batch of a seeded plan per epoch
    (kubealign.data.batching). With ppo.batching grouped, prompts of similar length share a rollout batch:
    less left padding in generation and in every pass over the rollouts after it."""
    per_epoch = len(lengths) // (cfg.generation_batch_size * world)
    epoch, j = divmod(step, per_epoch)
    return batching.epoch_plan(lengths, cfg.generation_batch_size, world, 1, cfg.seed, epoch, cfg.batching)[j][rank]


def prompt_batch(prompts: list[list[int]], order: list[int], pad: int):
    """The prompts at `order` (prompt_order's), left-padded, on the device."""
    ids, mask = pad_batch([prompts[i] for i in order], pad, "left")
    device = distributed.device()
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


@torch.no_grad()
def evaluate(
    models: rollout.PPOModels, prompts: list[list[int]], cfg: PPOConfig, rows: Rows | None = None
) -> dict[str, float]:
    """Mean reward and KL to the reference on the eval prompts (rows: theirs, for reward functions), sampled
    with a fixed seed (the training RNG, CPU and GPU, is left untouched); with reward functions also each
    one's mean, fn/<NAME>."""
    scores, kls, totals = [], [], {}
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []  # generate samples on the GPU
    with torch.random.fork_rng(devices=cuda), engines.awake(models):
        torch.manual_seed(cfg.seed)
        for i in range(0, len(prompts), cfg.generation_batch_size):
            ids, mask = pad_batch(prompts[i : i + cfg.generation_batch_size], models.tokenizer.pad_token_id, "left")
            ids, mask = torch.tensor(ids, device=distributed.device()), torch.tensor(mask, device=distributed.device())
            prompt_rows = rows.take(list(range(i, i + ids.shape[0]))) if rows else None
            if models.tools is not None:  # the same turns as training: tools or the environment answer
                batch = multiturn.rollout(models, ids, mask, cfg, models.tools, prompt_rows)
            else:
                batch = rollout.generate(models, ids, mask, cfg)
            chunk = prompt_rows.repeat(cfg.group_size) if prompt_rows else None
            exp = experience.make_experience(
                batch, mask, models.tokenizer.eos_token_id, models, losses.Sampling.of(cfg), chunk
            )
            exp = multiturn.with_environment_rewards(exp, getattr(batch, "env_rewards", None))
            scores += exp.scores.tolist()
            kls += (exp.logprobs - exp.ref_logprobs).sum(-1).tolist()  # both are 0 outside the response
            totals = function_totals(exp.functions or {}, totals)
    return {"reward": sum(scores) / len(scores), "kl": sum(kls) / len(kls), **function_means(totals)}


def tool_session(config: KubealignConfig, models: rollout.PPOModels, runner: Any) -> multiturn.ToolSession:
    """The multi-turn rollouts' tools (or environment), run by the reward-function worker (rewards' limits). With
    the actor at ZeRO-3 on several ranks the ranks take their turns in lockstep (multiturn._any_rank_going)."""
    return multiturn.ToolSession(config.tools, runner, models.tokenizer)


def unsupervised_data(cfg: PPOConfig, prompts: Path, tokenizer: Any):
    """Phase-1 SFT sequences for the PPO-ptx loss (ppo.unsup_coef > 0), from the same data-split dir."""
    if cfg.unsup_coef == 0:
        return None
    from kubealign.training.lm import tokenize

    if not (prompts / "phase1_sft").is_dir():
        raise UserError(f"ppo.unsup_coef > 0 needs --prompts to be the data-split dir (with phase1_sft), got {prompts}")
    rows = phases.load(prompts, "phase1_sft")["train"]
    examples = tokenize(rows, tokenizer, cfg.max_prompt_len + cfg.max_new_tokens, include_prompt=False)
    rank, world = distributed.init()
    return unsupervised.UnsupervisedData(examples, cfg.micro_batch_size, tokenizer.pad_token_id, rank=rank, world=world)


def say_rollout(models: rollout.PPOModels, cfg: PPOConfig, notes: list[str], main: bool) -> None:
    """On screen (rank 0): the rollout engine picked and why (build_models's last note), and on a GPU what the
    generation batch takes of the memory the resident engines left (added to the notes too)."""
    said = [notes[-1]]
    if torch.cuda.is_available():
        hf = getattr(models.actor.module, "get_base_model", lambda: models.actor.module)()
        said.append(memory.note(hf.config, cfg, torch.cuda.mem_get_info()[0]))
        notes.append(said[-1])
    if main:
        print("\n".join(f"ppo: {line}" for line in said), flush=True)


def diverged(exc: NonFiniteLoss, cfg: PPOConfig, step: int, checkpoints: Path) -> UserError:
    """The one line of a non-finite loss or experience at iteration STEP."""
    lrs = f"actor learning rate {cfg.actor_learning_rate:g}, critic {cfg.critic_learning_rate:g}; too high?"
    frozen = isinstance(exc, experience_checks.NonFiniteExperience) and not exc.trained  # no learning rate made that
    hint = "" if frozen else f" ({lrs})"
    return UserError(
        f"{STAGE}: {exc} at iteration {step}{hint}; stopped before applying it, no model was written, "
        f"{checkpoint_note(checkpoints / 'latest')}"
    )


def log_samples(models: rollout.PPOModels, cfg: PPOConfig, exp: Any, tracker: Any, step: int) -> None:
    """Every sample_every_iterations: four of the iteration's prompts + responses as an MLflow text artifact."""
    if cfg.sample_every_iterations and step % cfg.sample_every_iterations == 0:
        texts = models.tokenizer.batch_decode(exp.input_ids[:4], skip_special_tokens=True)
        tracker.log_text("\n\n---\n\n".join(texts), f"samples/iteration_{step:05d}.txt")


def save_or_stop(
    models: rollout.PPOModels,
    cfg: PPOConfig,
    checkpoints: Path,
    step: int,
    state: tuple,
    tracker: Any,
    stop: preemption.StopRequest,
) -> None:
    """At the end of iteration STEP: the periodic checkpoint; then a SIGTERM / SIGINT on any rank (agreed by
    all) saves, unless just saved, and stops every rank here. state: (KL controller, EMA, client state)."""
    saved = bool(cfg.save_every_iterations) and step % cfg.save_every_iterations == 0
    if saved:
        ppo_state.save_checkpoint(models, checkpoints, step, *state)
        tracker.flush()  # MLflow holds what the checkpoint does (bounded; no wait while it is down)
    fault_hook(step)
    signum = stop.agreed()
    if signum:
        if not saved:
            ppo_state.save_checkpoint(models, checkpoints, step, *state)
        tracker.flush()
        raise preemption.stopped(STAGE, signum, f"iteration {step}", str(checkpoints / f"iter{step}"))


def show(bar: Any, reporter: progress.Reporter, metrics: dict[str, float], step: int, total: int) -> None:
    """Iteration STEP of TOTAL on screen (rank 0's bar) and, in a TrainJob, on its status (progress.Reporter: the
    percentage, the time left, the main metrics; throttled, the last iteration always)."""
    bar.update()
    bar.set_postfix(
        reward=f"{metrics['reward_mean']:.3f}",
        kl=f"{metrics['kl']:.3f}",
        samples_s=f"{metrics['samples_per_s']:.2f}",
        generating=f"{metrics['generation_share']:.0%}",
    )
    reporter.report(step, total, {"iteration": step, **metrics}, final=step == total)


def train(
    models: rollout.PPOModels,
    cfg: PPOConfig,
    prompts,
    eval_prompts,
    checkpoints: Path,
    resume: bool,
    tracker,
    unsup,
    rows: Rows | None = None,
    eval_rows: Rows | None = None,
):
    """The iteration loop (rows / eval_rows: the prompts' rows, for reward functions); returns (history, before,
    after, time split)."""
    from tqdm import tqdm

    rank, world = distributed.init()
    if len(prompts) < cfg.generation_batch_size * world:
        raise UserError(
            f"ppo.generation_batch_size: {cfg.generation_batch_size} x {world} rank(s) is more than the "
            f"{len(prompts)} phase-3 training prompts"
        )
    lengths = [len(p) for p in prompts]
    controller = kl.KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    ema = ppo_state.EMA(cfg.ema_coef) if cfg.ema_coef else None
    state = (
        ppo_state.load_checkpoint(models, checkpoints, controller, ema, cfg.algorithm) if resume else {"iteration": 0}
    )
    start = state["iteration"]
    if start and rank == 0:  # a restarted pod's log says where it went on from (a TrainJob's node after a loss)
        print(f"{STAGE}: resuming after iteration {start} from {checkpoints}", flush=True)
    before = state.get("before") or evaluate(models, eval_prompts, cfg, eval_rows)
    history = state.get("history", [])
    tracker.log_metrics({f"eval_{k}": v for k, v in before.items()}, step=0)
    gen = torch.Generator().manual_seed(cfg.seed)
    if start:
        gen.set_state(state["minibatch_rng"])
        if unsup is not None:
            unsup.served = state["unsup_served"]
    bar = tqdm(total=cfg.num_iterations, initial=start, desc=STAGE, unit="iter", **({"disable": True} if rank else {}))
    reporter = progress.Reporter(rank == 0, first=start)  # the TrainJob's status.trainerStatus (in a TrainJob)
    with preemption.StopRequest() as stop:
        try:
            for step in range(start + 1, cfg.num_iterations + 1):
                order = prompt_order(lengths, step - 1, cfg, rank, world)
                ids, mask = prompt_batch(prompts, order, models.tokenizer.pad_token_id)
                batch_rows = rows.take(order) if rows else None
                try:
                    metrics, exp = iteration(models, ids, mask, cfg, controller, gen, unsup, batch_rows)
                except NonFiniteLoss as exc:  # raised on every rank at once; the checkpoints stay as last saved
                    raise diverged(exc, cfg, step, checkpoints) from None
                if ema is not None:
                    ema.update(models.actor.module)
                history.append({"iteration": step, **metrics})
                tracker.log_metrics(metrics, step=step)
                show(bar, reporter, metrics, step, cfg.num_iterations)
                log_samples(models, cfg, exp, tracker, step)
                served = unsup.served if unsup is not None else 0
                extra = {
                    "before": before,
                    "history": history,
                    "minibatch_rng": gen.get_state(),
                    "algorithm": cfg.algorithm,
                    "unsup_served": served,
                }
                save_or_stop(models, cfg, checkpoints, step, (controller, ema, extra), tracker, stop)
        finally:
            bar.close()
    after = evaluate(models, eval_prompts, cfg, eval_rows)
    if nonfinite(after):  # the last update can diverge the actor with no loss computed after it
        raise UserError(
            f"{STAGE}: the evaluation after the last iteration gives {nonfinite(after)}: the actor diverged (actor "
            f"learning rate {cfg.actor_learning_rate:g}; too high?); no model was written, "
            f"{checkpoint_note(checkpoints / 'latest')}"
        )
    tracker.log_metrics({f"eval_{k}": v for k, v in after.items()}, step=cfg.num_iterations)
    return history, before, after, ema


def run(
    config: KubealignConfig,
    prompts: Path,
    actor: Path,
    critic: Path | None,
    reward: Path | None,
    output: Path,
    resume: bool = False,
    functions: list[definitions.FunctionSpec] | None = None,
    checkpoint_location: Path | None = None,
) -> dict:
    """PPO (or GRPO / RLOO: ppo.algorithm) on DATA's phase 3, from the SFT dir (actor + reference), scored by
    the reward model (--reward, else --critic) and / or the reward functions: `functions` as a pipeline task
    was handed them (their source embedded), else resolved from config.rewards. See model_dirs for the critic."""
    cfg = config.ppo
    check_output_path(output, STAGE)
    checkpoint_dir = checkpoints.checkpoint_dir(output, resume, checkpoint_location)
    reward_flag = "--reward" if reward is not None else "--critic"
    critic, reward = ppo_models.model_dirs(cfg, config.rewards, actor, critic, reward)
    ppo_models.check_inputs(cfg, actor, critic, reward, reward_flag)
    specs = definitions.resolve_all(config.rewards, config.tools, config.base_dir) if functions is None else functions
    definitions.check_matches(specs, config.rewards, config.tools)
    dataset = phases.load(prompts, "phase3_prompts")
    if len(dataset["train"]) == 0:
        raise UserError(f"--prompts {prompts}: the phase3_prompts train split is empty")
    rank, world = distributed.init()
    distributed.seed_everything(cfg.seed)
    started = time.perf_counter()
    r = config.rewards
    runner = FunctionRunner.for_config(specs, r) if specs else None
    opened = ExitStack()
    with stage_run(STAGE, config, output.resolve().parent, required=False) as tracker, runner or nullcontext(), opened:
        models, check = ppo_models.build_models(
            cfg, str(actor), critic and str(critic), reward and str(reward), world, config.rewards.model_weight, runner
        )
        opened.callback(engines.close, models)  # a vLLM engine shuts down before the trainer's process group
        tracker.log_params(
            {"ppo.rollout_path": check.path, "ppo.rollout_engine": models.engine, "ppo.group_size": cfg.group_size}
        )
        say_rollout(models, cfg, check.notes, rank == 0)
        tracker.log_inputs([ref] if (ref := phase_ref(prompts, "phase3_prompts", "training")) else [])
        if config.tools.enabled:
            models.tools = tool_session(config, models, runner)
        tracker.set_tags({"kubealign.rollout_notes": " | ".join(check.notes)})
        rows, eval_rows = phases.prompt_rows(dataset["train"]), phases.prompt_rows(dataset["eval"])
        train_prompts = encode_prompts(dataset["train"], models.tokenizer, cfg.max_prompt_len)
        eval_prompts = encode_prompts(dataset["eval"], models.tokenizer, cfg.max_prompt_len)[:32]
        eval_rows = eval_rows.take(list(range(len(eval_prompts))))
        if not eval_prompts:  # no eval split: the first training prompts
            eval_prompts, eval_rows = train_prompts[:8], rows.take(list(range(min(8, len(train_prompts)))))
        unsup = unsupervised_data(cfg, prompts, models.tokenizer)
        history, before, after, ema = train(
            models, cfg, train_prompts, eval_prompts, checkpoint_dir, resume, tracker, unsup, rows, eval_rows
        )
        summary = {
            **summarize(history, before, after),
            "wall_time_s": time.perf_counter() - started,
            "world_size": world,
        }
        critic_out = {"critic": "critic"} if models.critic is not None else {}
        result = {
            "stage": STAGE,
            "algorithm": cfg.algorithm,
            "samples_per_prompt": cfg.group_size,
            "metrics": summary,
            "outputs": {"model": ".", **critic_out, **({"ema": "ema"} if ema else {})},
            "rollout_path": check.path,
            "rollout_engine": models.engine,
            "rollout_notes": check.notes,
            "kl_target": cfg.kl_target,
            "history": history,
            "tracked_metrics": list(tracker.history),  # every metric, whether MLflow got it or not
        }
        write_outputs(models, cfg, ema, output, result)
        tracker.log_metrics(summary)
        tracker.set_tags({"kubealign.model_dir": str(output.resolve())})
        if rank == 0:
            tracker.log_artifact(output / "result.json", STAGE)
    checkpoints.remove(checkpoint_dir)  # every rank: only what kubealign wrote there
    return {**result, "output": str(output), "run_id": tracker.run_id}


def summarize(history: list[dict], before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """result.json's metrics of a finished run: eval reward and KL before / after (each reward function's
    too), the first and last iterations' training figures, the time split."""
    return {
        "reward_before": before["reward"],
        "reward_after": after["reward"],
        "kl_before": before["kl"],
        "kl_after": after["kl"],
        "train_reward_first": history[0]["reward_mean"],
        "train_reward_last": history[-1]["reward_mean"],
        "train_kl_last": history[-1]["kl"],
        "kl_coef_last": history[-1]["kl_coef"],
        "generation_time_s": sum(h["generation_time_s"] for h in history),
        "experience_time_s": sum(h["experience_time_s"] for h in history),
        "training_time_s": sum(h["training_time_s"] for h in history),
        **rates(history),
        **{f"{k}/before": v for k, v in before.items() if k.startswith("fn/")},
        **{f"{k}/after": v for k, v in after.items() if k.startswith("fn/")},
    }


def rates(history: list[dict]) -> dict[str, float]:
    """samples_per_s and generation_share over the iterations alone (evaluation and start-up excluded): what a
    rollout engine or the generation batch changes. An iteration's time is its three parts' sum."""
    times = [h["generation_time_s"] + h["experience_time_s"] + h["training_time_s"] for h in history]
    total = max(sum(times), 1e-9)
    samples = sum(h["samples_per_s"] * t for h, t in zip(history, times, strict=True))
    return {"samples_per_s": samples / total, "generation_share": sum(h["generation_time_s"] for h in history) / total}


def write_outputs(
    models: rollout.PPOModels, cfg: PPOConfig, ema: ppo_state.EMA | None, output: Path, result: dict
) -> None:
    """Actor (adapters merged) at DIR, critic at DIR/critic (ppo), EMA at DIR/ema — one atomic output."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    actor, hashes = export.gather_model(models.actor, AutoModelForCausalLM, cfg.actor_lora, "CAUSAL_LM")
    critic = None
    if models.critic is not None:  # gathered on every rank (collective under ZeRO-3), written by rank 0
        critic, _ = export.gather_model(models.critic, AutoModelForSequenceClassification, cfg.critic_lora, "SEQ_CLS")
    if actor is not None:
        with atomic_dir(output) as tmp:
            export.write_model(actor, cfg.actor_lora, models.tokenizer, tmp)
            if critic is not None:
                export.write_model(critic, cfg.critic_lora, models.tokenizer, tmp / "critic")
            if ema is not None:
                module = models.actor.module
                base = module.get_base_model().config if hasattr(module, "get_base_model") else module.config
                ema_model = export.build_cpu_model(AutoModelForCausalLM, base, cfg.actor_lora, "CAUSAL_LM", ema.state)
                export.write_model(ema_model, cfg.actor_lora, models.tokenizer, tmp / "ema")
            # environment: the device and libraries it trained with, for the version's manifest (kubealign.provenance)
            write_result(tmp, **result, rank_param_sha256=hashes, environment=environment())
    distributed.barrier()
