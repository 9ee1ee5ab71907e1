"""The ppo section (PPO, GRPO, RLOO with the DeepSpeed Hybrid Engine)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from kubealign.config.base import DType, Section
from kubealign.config.train import LoraConfig
from kubealign.shape import RL_ROUTES, has_critic

ROLLOUT_ENGINES = ("auto", "hf", "compiled", "vllm")
# nats: a mean |log-prob difference| no exact engine comes near (fp32: ~1e-6; bf16 kernels: ~1e-2), which stale
# weights or another sampling distribution exceed after a few updates.
DEFAULT_MAX_LOGPROB_DIFF = 0.1


class HybridEngineConfig(Section):
    """DeepSpeed's `hybrid_engine` block for the actor (deepspeed.runtime.hybrid_engine)."""

    enabled: bool = Field(True, description="Create the actor as a DeepSpeedHybridEngine.")
    max_out_tokens: int = Field(512, ge=1, description="Inference KV-cache budget, tokens.")
    inference_tp_size: int = Field(1, ge=1, description="Tensor-parallel degree for generation.")
    release_inference_cache: bool = Field(False, description="Free the KV cache after each rollout.")
    pin_parameters: bool = Field(True, description="Pin gathered ZeRO-3 params during generation.")
    tp_gather_partition_size: int = Field(8, ge=1, description="Layers gathered at once for TP.")


class RolloutCorrectionConfig(Section):
    """How the policy loss corrects for the rollout sampling from other probabilities than the trainer computes
    for the same tokens (kubealign.rl.correction): w = pi_trainer / pi_rollout per response token."""

    kind: Literal["none", "tis", "mask"] = Field(
        "none",
        description="none: no correction (the mismatch is still measured and logged); tis: each token's policy loss "
        "times min(w, cap), truncated importance sampling (TRL's token_truncate, veRL's rollout_is); mask: tokens "
        "with w outside [low, high] are left out of the policy loss (TRL's token_mask, veRL's token rejection).",
    )
    cap: float = Field(2.0, ge=1, description="tis: the largest weight a token gets (w is truncated to it).")
    low: float = Field(0.5, ge=0, le=1, description="mask: the smallest w a token may have and still count.")
    high: float = Field(2.0, ge=1, description="mask: the largest w a token may have and still count.")


class RolloutEngineConfig(Section):
    """What generates the RL routes' rollouts (kubealign.rl.engines): every engine samples from the same
    distribution (temperature, top-k, top-p, EOS, per-row budgets, stop strings) and records the log-prob each
    sampled token had, so the rollout-trainer mismatch is measured whatever the engine."""

    engine: Literal[ROLLOUT_ENGINES] = Field(
        "auto",
        description="hf: transformers' generate loop (through DeepSpeed's rollout API: the hybrid engine's path); "
        "compiled: the same loop with a static KV cache and the forward compiled by torch.compile (CUDA graphs on "
        "a GPU: the decode step's ~1,300 kernel launches replayed as one); vllm: a vLLM engine in the trainer's "
        "own process, the actor's weights loaded into it before each rollout, its own log-probs returned (needs "
        "the vLLM trainer environment, make .venv-vllm/.installed); auto: the preflight picks (kubealign.rl."
        "engines.choose; one line says which and why).",
    )
    max_logprob_diff: float | None = Field(
        None,
        gt=0,
        description="The run stops (one line) when an iteration's mean |log pi_trainer - log pi_rollout| over its "
        "response tokens exceeds this, nats: an engine that samples from other weights or another distribution "
        f"than the trainer's. None = {DEFAULT_MAX_LOGPROB_DIFF} for the compiled and vllm engines, no bound for hf. "
        "Not checked with top_k or top_p set (the difference then measures the filter, not the engine).",
    )
    compile_mode: Literal["auto", "default", "reduce-overhead", "max-autotune"] = Field(
        "auto",
        description="compiled: torch.compile's mode; auto = reduce-overhead (CUDA graphs) on a GPU, default on CPU.",
    )
    vllm_memory: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="vllm: the share of the GPU's memory vLLM may take (weights and KV cache; its "
        "gpu_memory_utilization); the training engines share the rest.",
    )
    vllm_sleep: bool = Field(
        True,
        description="vllm: put the engine to sleep between rollouts (vLLM's sleep mode: its KV cache freed, its "
        "weights offloaded), so the update gets the memory back; a no-op on CPU, where vLLM has no sleep mode.",
    )
    vllm_kv_cache_gib: float = Field(
        1.0, gt=0, description="vllm on CPU: vLLM's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE; its default takes most RAM)."
    )

    def bound(self, engine: str) -> float | None:
        """The mismatch bound that applies to the engine actually picked."""
        if self.max_logprob_diff is not None:
            return self.max_logprob_diff
        return None if engine == "hf" else DEFAULT_MAX_LOGPROB_DIFF


class PPOConfig(Section):
    algorithm: Literal[RL_ROUTES] = Field(
        "ppo",
        description="ppo: clipped PPO with a critic and GAE; grpo: critic-free, group-relative advantages over "
        "samples_per_prompt responses, KL to the reference as a loss term; rloo: critic-free, leave-one-out "
        "baseline over samples_per_prompt responses. The ppo task's loss; what the DAG trains is chosen by "
        "pipeline.candidates, and each candidate's route sets this in its ppo task (with no candidates, the "
        "one route is this).",
    )
    actor_zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage of the actor.")
    critic_zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage of the critic.")
    reference_zero_stage: int | None = Field(None, ge=0, le=3, description="None = actor's stage.")
    reward_zero_stage: int | None = Field(None, ge=0, le=3, description="None = actor's stage.")
    offload_reference: bool = Field(False, description="Offload reference and reward models to CPU.")
    dtype: DType = Field("fp32", description="Precision of all four models.")
    actor_learning_rate: float = Field(1e-4, gt=0, description="Actor peak learning rate.")
    critic_learning_rate: float = Field(5e-5, gt=0, description="Critic peak learning rate.")
    actor_gradient_checkpointing: bool = Field(False, description="Recompute actor activations.")
    critic_gradient_checkpointing: bool = Field(False, description="Recompute critic activations.")
    actor_lora: LoraConfig = Field(default_factory=LoraConfig, description="Actor LoRA adapters.")
    critic_lora: LoraConfig = Field(default_factory=LoraConfig, description="Critic LoRA adapters.")
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig, description="Actor HE.")
    generation_batch_size: int = Field(8, ge=1, description="Prompts per device per rollout.")
    micro_batch_size: int = Field(8, ge=1, description="Samples per device per PPO micro-step.")
    batching: Literal["grouped", "padded"] = Field(
        "grouped",
        description="grouped: each rollout batch's prompts of similar lengths (less left padding in generation "
        "and every pass after it; kubealign.data.batching); padded: plain shuffled prompt batches.",
    )
    samples_per_prompt: int | None = Field(
        None,
        ge=1,
        description="Responses sampled per prompt, kept together as one group (grpo / rloo compare them with "
        "each other; they need >= 2); None = 1 for ppo, 4 for grpo and rloo.",
    )
    max_prompt_len: int = Field(64, ge=1, description="Prompt cap (left-truncated), tokens.")
    max_new_tokens: int = Field(32, ge=1, description="Response cap, tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    reuse_first_forward: Literal["none", "actor", "both"] = Field(
        "actor",
        description="The update's first minibatch takes these models' forwards (with their autograd graphs) from "
        "the experience pass instead of running them again: the same loss and gradients, a forward less per "
        "iteration. actor: no more memory at the peak; both: also the critic's, its graph then held beside "
        "the actor's until the first step. approx_kl_first / clip_fraction_first are 0 by construction when "
        "the actor's is reused and not logged; none measures them from a second forward.",
    )
    num_iterations: int = Field(20, ge=1, description="Rollout + update iterations.")
    kl_coef: float = Field(
        0.1,
        ge=0,
        description="beta, the KL-to-reference coefficient (the initial one when kl_target is set). ppo: per-token "
        "penalty -beta * (log pi - log pi_ref) in the reward; rloo: the same penalty summed over the response, "
        "subtracted from the sequence reward; grpo: coefficient of the k3 KL loss term (mean per response token).",
    )
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL target, nats; None = fixed beta.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon, samples.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip epsilon (the lower bound 1 - eps).")
    cliprange_high: float | None = Field(
        None,
        gt=0,
        # TRL and the issue tracker spell it clip_range_high (TRL's epsilon_high): both keys are accepted
        validation_alias=AliasChoices("cliprange_high", "clip_range_high"),
        description="Upper clip epsilon: the ratio is clipped to [1 - cliprange, 1 + cliprange_high] (DAPO's "
        "clip-higher, e.g. 0.28 with cliprange 0.2: unlikely tokens can gain more); None = cliprange.",
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = Field(
        "ppo",
        description="How the ratio r of the new to the old policy weighs each response token's advantage "
        "(kubealign.rl.losses): ppo = PPO's token-level clip of r to [1 - cliprange, 1 + cliprange_high]; gspo = the "
        "same clip of the sequence ratio, the geometric mean of the response's token ratios (Zheng et al. 2025; "
        "its paper uses loss_aggregation sequence and bounds of 3e-4 / 4e-4); cispo = r's weight clipped to those "
        "bounds and held constant, so no token's gradient is dropped (MiniMax-M1; cliprange 1 = no lower bound); "
        "sapo = a soft sigmoid gate of r instead of the clip (TRL's sapo, temperatures below).",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="sapo: the gate's temperature for positive advantages (higher = closer to a clip)."
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="sapo: the gate's temperature for zero and negative advantages."
    )
    rollout: RolloutEngineConfig = Field(
        default_factory=RolloutEngineConfig, description="The rollout engine and its mismatch bound."
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Correction of the policy loss for the rollout's log-probs differing from the trainer's (bf16 "
        "generation, the hybrid engine's inference kernels, top-k / top-p); the mismatch, mean and max |log "
        "ratio| of the two before the first update, is logged every iteration whatever is chosen.",
    )
    loss_aggregation: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="How the per-token policy loss (and grpo's k3 term) becomes one number: token = mean over every "
        "response token of the minibatch (DAPO, TRL's dapo); sequence = mean over responses of each one's token mean "
        "(DeepSeekMath); constant = sum over response tokens / (responses x max_new_tokens) (Dr. GRPO). Each count "
        "is over every rank's minibatch (a global mean, not a mean of per-rank means).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo only: divide each group-centred reward by its group's std (DeepSeekMath), by the std of "
        "every reward in the batch (TRL's 'batch'), or by nothing (Dr. GRPO).",
    )
    drop_equal_reward_groups: bool = Field(
        False,
        description="grpo / rloo: leave the groups whose rewards are all equal (no learning signal; their advantages "
        "are 0) out of the policy loss, its normalization and the entropy mean; their count is logged as "
        "groups_dropped. A step where no rank has a row left is skipped (skipped_steps).",
    )
    cliprange_value: float = Field(0.2, gt=0, description="Value clip epsilon.")
    reward_clip: float = Field(5.0, gt=0, description="Reward score clipped to [-c, c].")
    whiten_advantages: bool = Field(
        True, description="ppo only: normalize advantages per batch (grpo normalizes within each group, rloo not)."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    unsup_coef: float = Field(0.0, ge=0, description="Unsupervised LM loss coefficient (phase-1 data).")
    ema_coef: float | None = Field(None, gt=0, lt=1, description="Actor EMA decay; None disables EMA.")
    gradient_clipping: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 disables.")
    save_every_iterations: int = Field(0, ge=0, description="Checkpoint every N iterations; 0 = never.")
    sample_every_iterations: int = Field(5, ge=0, description="Log sample responses every N iterations.")
    seed: int = Field(1234, description="Seed of sampling and data order.")

    @property
    def group_size(self) -> int:
        """samples_per_prompt resolved: the responses per prompt (GRPO's / RLOO's group). None stays None in
        the config (so a resolved config dumped for the DAG and given --set ppo.algorithm=grpo still gets
        grpo's default) and is resolved here, where it is used."""
        if self.samples_per_prompt is not None:
            return self.samples_per_prompt
        return 1 if self.has_critic else 4

    @property
    def has_critic(self) -> bool:
        """Whether this variant trains a critic (ppo; grpo and rloo compare a prompt's responses instead)."""
        return has_critic(self.algorithm)

    @model_validator(mode="after")
    def _check_groups(self) -> PPOConfig:
        if not self.has_critic and self.group_size < 2:
            raise ValueError(
                f"ppo.algorithm {self.algorithm} needs ppo.samples_per_prompt >= 2 (got {self.group_size}): "
                "a group of one response has no baseline to compare it with"
            )
        return self
