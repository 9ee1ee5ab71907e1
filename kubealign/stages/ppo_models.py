"""The ppo stage's models: which directories they come from (checked), and the engines built from them
(actor with the hybrid engine when the preflight allows, critic, frozen reference and reward, the scorer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubealign.config.schema import PPOConfig, RewardsConfig, TrainConfig
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.models.value_head import load_reward_model
from kubealign.rewards.scorer import Scorer
from kubealign.rl import engines as rollout_engines
from kubealign.rl import preflight
from kubealign.rl.rollout import ModuleRollout, PPOModels, disable_dropout
from kubealign.training import engine as engines
from kubealign.usercode.runner import FunctionRunner

STAGE = "ppo"


def model_dirs(
    cfg: PPOConfig, rewards: RewardsConfig, actor: Path, critic: Path | None, reward: Path | None
) -> tuple[Path | None, Path | None]:
    """(critic dir or None, reward model dir or None) to load. The reward model: --reward, else --critic,
    when rewards use one. The critic (ppo only): --critic, else the reward model, else the SFT model (a new
    value head: with reward functions alone there is no reward model to start it from)."""
    reward_dir = None
    if rewards.uses_model:
        reward_dir = reward or critic
        if reward_dir is None:
            raise UserError(
                "ppo: --reward RM_DIR (or --critic RM_DIR) is needed: rewards.model_weight is "
                f"{rewards.model_weight:g}{'' if rewards.functions else ' and no rewards.functions are set'}; "
                "for reward functions alone set rewards.model_weight: 0"
            )
    critic_dir = (critic or reward_dir or actor) if cfg.has_critic else None
    return critic_dir, reward_dir


def check_inputs(
    cfg: PPOConfig, actor: Path, critic: Path | None, reward: Path | None, reward_flag: str = "--reward"
) -> None:
    """Model dirs of the right kind, and lengths that fit every model and the hybrid engine's KV budget.
    reward_flag: the option the reward model came from (--critic when it stands for both)."""
    wanted = [("--actor", actor, "ForCausalLM", "actor")]
    if critic is not None:  # a critic from the SFT model is a causal LM that gets a new value head
        wanted.append(("--critic", critic, "ForCausalLM" if critic == actor else "ForSequenceClassification", "critic"))
    if reward is not None:
        wanted.append((reward_flag, reward, "ForSequenceClassification", "reward model"))
    configs = {flag: loading.model_dir_config(flag, path, kind) for flag, path, kind, _ in wanted}
    total = cfg.max_prompt_len + cfg.max_new_tokens
    for flag, _, _, role in wanted:  # the critic and the reward model read the whole prompt + response too
        loading.check_fits("ppo.max_prompt_len + ppo.max_new_tokens", total, role, flag, configs[flag])
    if cfg.hybrid_engine.enabled and total > cfg.hybrid_engine.max_out_tokens:
        raise UserError(
            f"ppo.hybrid_engine.max_out_tokens {cfg.hybrid_engine.max_out_tokens} is less than "
            f"ppo.max_prompt_len + ppo.max_new_tokens = {total}"
        )


def train_config(cfg: PPOConfig, role: str) -> TrainConfig:
    """The engine options of the actor or the critic, in the shape the DeepSpeed config builder takes."""
    actor = role == "actor"
    return TrainConfig(
        zero_stage=cfg.actor_zero_stage if actor else cfg.critic_zero_stage,
        dtype=cfg.dtype,
        gradient_checkpointing=cfg.actor_gradient_checkpointing if actor else cfg.critic_gradient_checkpointing,
        micro_batch_size=cfg.micro_batch_size,
        learning_rate=cfg.actor_learning_rate if actor else cfg.critic_learning_rate,
        lr_scheduler="constant",
        gradient_clipping=cfg.gradient_clipping,
        seed=cfg.seed,
        lora=cfg.actor_lora if actor else cfg.critic_lora,
    )


def build_models(
    cfg: PPOConfig,
    actor_dir: str,
    critic_dir: str | None,
    reward_dir: str | None,
    world: int,
    model_weight: float = 1.0,
    runner: FunctionRunner | None = None,
) -> tuple[PPOModels, Any]:
    """Load the models and wrap them in DeepSpeed engines; returns (models, preflight). critic_dir None: no
    critic (grpo / rloo); reward_dir None: no reward model (the runner's functions alone score)."""
    from transformers import __version__ as transformers_version

    tokenizer = loading.load_tokenizer(actor_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    cuda = torch.cuda.is_available()
    actor_cfg, critic_cfg = train_config(cfg, "actor"), train_config(cfg, "critic")
    with engines.zero3_loading(engines.ds_config(actor_cfg, world, cuda)):
        actor = loading.load_causal_lm(actor_dir, dtype=loading.torch_dtype(cfg.dtype))
    hf = actor.config
    check = preflight.decide(
        cfg.hybrid_engine,
        cfg.actor_zero_stage,
        hf.model_type,
        hf.num_attention_heads,
        getattr(hf, "num_key_value_heads", None),
        cuda,
        transformers_version,
        preflight.would_inject(actor) if cfg.hybrid_engine.enabled else [],
        preflight.inference_kernels(),
    )
    critic = None
    if critic_dir is not None:  # grpo / rloo: the baseline is the prompt's other responses, not a critic
        with engines.zero3_loading(engines.ds_config(critic_cfg, world, cuda)):
            critic = load_reward_model(critic_dir, False, tokenizer.pad_token_id, cfg.dtype)
    reference = loading.load_causal_lm(actor_dir, dtype=loading.torch_dtype(cfg.dtype))
    reward = None if reward_dir is None else load_reward_model(reward_dir, False, tokenizer.pad_token_id, cfg.dtype)
    samples = cfg.generation_batch_size * cfg.group_size
    total = cfg.num_iterations * cfg.ppo_epochs * -(-samples // cfg.micro_batch_size)  # optimizer steps
    actor_engine = engines.trainable(actor, actor_cfg, "CAUSAL_LM", world, total, check.hybrid_engine)
    critic_engine = None if critic is None else engines.trainable(critic, critic_cfg, "SEQ_CLS", world, total, None)
    for engine in (actor_engine, critic_engine):
        if engine is not None:  # after LoRA is applied: PEFT's lora_dropout layers are dropout too
            disable_dropout(engine.module)
    ref_stage = cfg.actor_zero_stage if cfg.reference_zero_stage is None else cfg.reference_zero_stage
    reward_stage = cfg.actor_zero_stage if cfg.reward_zero_stage is None else cfg.reward_zero_stage
    reference = engines.frozen(reference, ref_stage, cfg.dtype, cfg.offload_reference, cfg.micro_batch_size, world)
    if reward is not None:
        reward = engines.frozen(reward, reward_stage, cfg.dtype, cfg.offload_reference, cfg.micro_batch_size, world)
    scorer = Scorer(reward, model_weight if runner is not None else 1.0, runner, tokenizer)
    synced = world > 1 and cfg.actor_zero_stage == 3  # each decode forward gathers parameters collectively
    picked = rollout_engines.choose(
        cfg.rollout.engine, cuda, world, cfg.actor_zero_stage, hf.model_type, rollout_engines.vllm_available()
    )
    check.notes.append(picked.note)
    if picked.engine == "vllm":
        from kubealign.rl.vllm_rollout import VLLMRollout

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        rollout = VLLMRollout(loading.resolve(actor_dir), tokenizer, cfg.dtype, cfg.seed + rank, cfg.rollout)
    elif check.path == "engine":
        rollout = ModuleRollout(actor_engine, tokenizer, synced_gpus=synced)
    else:
        from deepspeed.runtime.rollout import HybridEngineRollout, RolloutConfig

        rollout = HybridEngineRollout(engine=actor_engine, tokenizer=tokenizer, cfg=RolloutConfig())
    models = PPOModels(actor_engine, critic_engine, reference, scorer, rollout, tokenizer, synced)
    models.engine = picked.engine
    return models, check
