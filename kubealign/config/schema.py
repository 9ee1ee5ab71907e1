"""Typed, frozen configuration: one section per stage, one YAML file for all of them.

Every field has a default and a description with its unit. Models forbid unknown keys, so a typo in
a YAML file or a --set override is an error that names the field instead of a silently ignored knob.
Training fields follow DeepSpeed-Chat's flags; the `kubernetes` section is read only where the pipeline is
compiled (and by the ppo task for a multi-node TrainJob).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kubealign.shape import RL_ROUTES, ROUTES

SourceFormat = Literal[
    "auto", "prompt_chosen_rejected", "hh", "prompt_response", "prompt_completion", "messages", "prompt_only"
]
DType = Literal["fp32", "bf16", "fp16"]


class Section(BaseModel):
    # allow_inf_nan=False: every number of every section must be finite. A learning rate of .inf or a
    # coefficient of .nan passes gt=0 / ge=0 (inf > 0; nan fails no comparison pydantic makes) and trains a
    # NaN model with exit 0; refused here, with the field named.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DataSource(Section):
    path: str = Field(
        description="'synthetic' or 'synthetic-arithmetic' (built-in generators), a local "
        ".jsonl/.jsonl.gz/.json/.parquet file, a datasets save_to_disk dir, a local dataset dir, or a Hugging Face "
        "hub dataset name (loaded with datasets.load_dataset). Relative paths are resolved against the working "
        "directory."
    )
    format: SourceFormat = Field(
        "auto",
        description="Row schema; 'auto' detects it per row from the keys. prompt_chosen_rejected: "
        "Dahoas rm-static style; hh: HH-RLHF full chosen/rejected dialogues; prompt_response: SFT-only "
        "rows; prompt_completion: TRL's {prompt, completion} (strings or message lists), SFT-only rows; messages: "
        "chat-message lists; prompt_only: {prompt, ...} with no response, for phase 3 only (its other fields "
        "become columns the reward functions get).",
    )
    columns: list[str] = Field(
        default_factory=list,
        description="Fields of prompt-only rows to keep as columns for reward functions although their names "
        "look like a response (answer, completion, output, text, solution, target, ...): without this such a "
        "row is refused, naming the field, so that a demonstration is never silently dropped from SFT.",
    )
    limit: int | None = Field(None, gt=0, description="Use at most this many rows (the first ones), rows.")
    weight: float = Field(
        1.0,
        gt=0,
        description="Mixing weight for the train splits: this source's train rows are subsampled (<1) "
        "or repeated (>1) to weight x their count. Eval splits are never reweighted.",
    )
    split: str = Field("train", description="Split to read from hub / save_to_disk datasets.")
    name: str | None = Field(None, description="Dataset configuration name for hub datasets.")


class DataConfig(Section):
    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(path="synthetic")],
        description="Where rows come from; all sources are normalized and pooled before the split.",
        min_length=1,
    )
    split_ratios: tuple[float, float, float] = Field(
        (2.0, 4.0, 4.0),
        description="Relative sizes of phase 1 (SFT), 2 (reward) and 3 (PPO prompts), over unique "
        "preference prompts; '2,4,4' = 20/40/40 %. Accepts a list or a comma-separated string.",
    )
    eval_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Fraction of each phase's prompts held out as its eval split."
    )
    seed: int = Field(1234, description="Seed of the split permutation and of the synthetic generator.")
    on_error: Literal["raise", "skip"] = Field(
        "raise",
        description="A malformed row (bad JSON/UTF-8, wrong type, unknown schema): 'raise' stops with "
        "an error naming file, line and field; 'skip' drops it and reports it in the manifest.",
    )
    synthetic_pairs: int = Field(1000, ge=1, description="Preference rows the 'synthetic' source generates, rows.")
    synthetic_sft_rows: int = Field(
        200,
        ge=0,
        description="Extra SFT-only (prompt/response) rows of 'synthetic' (of 'synthetic-arithmetic': "
        "its demonstrations), rows.",
    )
    synthetic_prompts: int = Field(
        500, ge=0, description="Prompt-only rows {prompt, answer} of 'synthetic-arithmetic' (phase 3 only), rows."
    )
    report_examples: int = Field(5, ge=0, description="How many example locations the manifest keeps per drop reason.")

    @field_validator("split_ratios", mode="before")
    @classmethod
    def _parse_ratios(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                value = [float(p.strip()) for p in value.split(",")]
            except ValueError:
                raise ValueError(f"expected three comma-separated numbers like '2,4,4', got {value!r}") from None
        if isinstance(value, list | tuple) and len(value) != 3:
            raise ValueError(f"expected three ratios (SFT, reward, PPO) like '2,4,4', got {len(value)}")
        return value

    @field_validator("split_ratios")
    @classmethod
    def _check_ratios(cls, value: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(r < 0 for r in value) or sum(value) <= 0:
            raise ValueError(f"ratios must be >= 0 with a positive sum, got {list(value)}")
        return value


class LoraConfig(Section):
    r: int = Field(0, ge=0, description="LoRA rank; 0 disables LoRA (full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input, probability.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "fc1", "fc2"],
        description="Module-name suffixes that get adapters (PEFT target_modules).",
    )
    only_lora: bool = Field(False, description="Train only the adapters; base weights stay frozen.")
    learning_rate: float | None = Field(
        None, gt=0, description="Learning rate of the adapter parameters; None = the stage's rate."
    )
    save_adapter: bool = Field(False, description="Also save the unmerged PEFT adapter in DIR/adapter.")


class TrainConfig(Section):
    """Engine options shared by the SFT and reward stages (DeepSpeed-Chat step 1/2 flags)."""

    model: str = Field("tiny-opt", description="tiny-opt, tiny-llama, a hub model id or a local HF dir.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model repo/dir.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    offload: bool = Field(False, description="Offload optimizer state and (ZeRO-3) params to CPU.")
    dtype: DType = Field("fp32", description="Training precision; fp32 on CPU.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    fp32_loss: bool = Field(True, description="Compute the loss from fp32-upcast logits under bf16/fp16.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per device per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    learning_rate: float = Field(1e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="HF schedule.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, optimizer steps.")
    num_train_epochs: float = Field(1.0, gt=0, description="Passes over the train split, epochs.")
    max_seq_len: int = Field(128, ge=8, description="Prompt + response length cap, tokens.")
    gradient_clipping: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 disables.")
    seed: int = Field(1234, description="Seed of model init, data order and dropout.")
    eval_every_steps: int = Field(0, ge=0, description="Evaluate every N optimizer steps; 0 = end only.")
    save_every_steps: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0 = never.")
    keep_checkpoints: bool = Field(False, description="Keep DIR.checkpoints after a successful export.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="PEFT LoRA adapters.")


class SFTConfig(TrainConfig):
    include_prompt_in_loss: bool = Field(
        False, description="Also train on prompt tokens (DeepSpeed-Chat does); default: response only."
    )


class RewardConfig(TrainConfig):
    learning_rate: float = Field(5e-4, gt=0, description="Peak learning rate.")


class DPOConfig(TrainConfig):
    """Direct Preference Optimization (Rafailov et al. 2023) on the phase-2 preference pairs. `model` is the
    policy to start from, normally the sft stage's output (the DAG passes it); the frozen reference is the
    same weights (with LoRA: the base with the adapters disabled, no second copy)."""

    model: str = Field("tiny-opt", description="Policy to start from: the SFT output dir (DAG) or a model name.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    beta: float = Field(0.1, gt=0, description="DPO beta: strength of the implicit KL to the reference.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cDPO / robust DPO: assumed probability that a pair's label is flipped."
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: DPO eq. 7 on summed response log-probs (with label smoothing: cDPO); ipo: IPO's "
        "squared loss (h - 1/(2 beta))^2 on per-token mean log-probs (TRL's convention).",
    )
    rpo_alpha: float = Field(
        0.0,
        ge=0,
        description="RPO (Pang et al. 2024; TRL's rpo_alpha): add this x the policy's mean NLL per chosen-response "
        "token to the loss; 0 = plain DPO.",
    )

    @model_validator(mode="after")
    def _check_dpo(self) -> DPOConfig:
        # With LoRA the reference is this very model with its adapters disabled: the base weights must not
        # train, or the reference would move with the policy.
        if self.lora.r > 0 and not self.lora.only_lora:
            raise ValueError(
                "lora.r > 0 makes the reference the base model with the adapters disabled, so the base must stay "
                "frozen: set lora.only_lora: true (or lora.r: 0 for a full fine-tune with a frozen copy)"
            )
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            raise ValueError("label_smoothing applies to loss_type sigmoid (cDPO) only, not ipo")
        return self


class HybridEngineConfig(Section):
    """DeepSpeed's `hybrid_engine` block for the actor (deepspeed.runtime.hybrid_engine)."""

    enabled: bool = Field(True, description="Create the actor as a DeepSpeedHybridEngine.")
    max_out_tokens: int = Field(512, ge=1, description="Inference KV-cache budget, tokens.")
    inference_tp_size: int = Field(1, ge=1, description="Tensor-parallel degree for generation.")
    release_inference_cache: bool = Field(False, description="Free the KV cache after each rollout.")
    pin_parameters: bool = Field(True, description="Pin gathered ZeRO-3 params during generation.")
    tp_gather_partition_size: int = Field(8, ge=1, description="Layers gathered at once for TP.")


class PPOConfig(Section):
    algorithm: Literal[RL_ROUTES] = Field(
        "ppo",
        description="ppo: clipped PPO with a critic and GAE; grpo: critic-free, group-relative advantages over "
        "samples_per_prompt responses, KL to the reference as a loss term; rloo: critic-free, leave-one-out "
        "baseline over samples_per_prompt responses. In the DAG, pipeline.algorithm sets it.",
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
        return 1 if self.algorithm == "ppo" else 4

    @model_validator(mode="after")
    def _check_groups(self) -> PPOConfig:
        if self.algorithm != "ppo" and self.group_size < 2:
            raise ValueError(
                f"ppo.algorithm {self.algorithm} needs ppo.samples_per_prompt >= 2 (got {self.group_size}): "
                "a group of one response has no baseline to compare it with"
            )
        return self


class EvaluateConfig(Section):
    max_prompts: int = Field(64, ge=1, description="Phase-3 eval prompts to generate for.")
    batch_size: int = Field(8, ge=1, description="Prompts per generation batch.")
    max_new_tokens: int = Field(32, ge=1, description="Response cap, tokens.")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature (same for both models).")
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables (not the model's default of 50).")
    seed: int = Field(1234, description="Sampling seed shared by baseline and candidate.")
    sample_rows: int = Field(20, ge=0, description="Rows in the HTML/Markdown sample table.")


class PromoteConfig(Section):
    registered_model: str = Field("kubealign-actor", min_length=1, description="Registry model name.")
    min_win_rate: float = Field(0.5, ge=0, le=1, description="Gate: candidate win-rate over baseline.")
    min_win_rate_lower_bound: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Gate: the 95 % bootstrap lower bound of the win-rate (evaluate's win_rate_lower_bound) must "
        "reach this; None = not checked. A point estimate on a few dozen prompts is noise; the bound is not.",
    )
    min_reward_gain: float = Field(0.0, description="Gate: mean reward gain over baseline, reward units.")
    max_kl: float | None = Field(None, gt=0, description="Gate: max KL to baseline, nats; None = no cap.")
    require_beat_champion: bool = Field(True, description="Also beat the current @champion's metrics.")
    metric: str = Field(
        "win_rate",
        min_length=1,
        description="What the gate ranks by: win_rate (min_win_rate, min_win_rate_lower_bound, and the champion's "
        "candidate_reward_mean) or another evaluate metric, e.g. fn/<NAME>/candidate (a reward function's mean): "
        "then it must reach min_metric, exceed the SFT baseline's (fn/<NAME>/baseline) and the champion's value "
        "in place of the win-rate checks.",
    )
    min_metric: float | None = Field(None, description="Threshold of `metric` when it is not win_rate; None = none.")

    @model_validator(mode="after")
    def _check_metric(self) -> PromoteConfig:
        if self.metric == "win_rate" and self.min_metric is not None:
            raise ValueError("promote.min_metric applies to another promote.metric; the win-rate's is min_win_rate")
        return self


class RewardFunction(Section):
    path: str = Field(
        description="FILE.py:NAME (a Python file, relative to the config file) or module:NAME (an importable "
        "module): a function f(prompts, completions, **columns) -> list[float | None], one value per completion.",
        min_length=3,
    )
    weight: float = Field(1.0, description="Its weight in the score: model_weight * RM + sum(weight * f).")

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        where, sep, name = value.rpartition(":")
        if not sep or not where or not name.isidentifier():
            raise ValueError(f"expected FILE.py:NAME or module:NAME, got {value!r}")
        return value

    @property
    def name(self) -> str:
        """The function's name (what metrics fn/<NAME>/... and errors call it)."""
        return self.path.rpartition(":")[2]


class RewardsConfig(Section):
    """What scores a response in ppo / grpo / rloo and in evaluate: the reward model, reward functions as code
    (verifiable rewards), or both. Functions are the user's own code and run with the task's permissions."""

    functions: list[RewardFunction] = Field(default_factory=list, description="Reward functions, in order.")
    model_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the reward model's score; 0 with functions = no reward model at all (the reward "
        "stage is skipped in the DAG, ppo's critic starts from the SFT model with a new value head).",
    )
    timeout_s: float = Field(60.0, gt=0, description="Per-call limit of one reward function on one batch, s.")

    @property
    def uses_model(self) -> bool:
        """Whether a reward model is trained and scores responses."""
        return self.model_weight > 0 or not self.functions

    @model_validator(mode="after")
    def _check_functions(self) -> RewardsConfig:
        names = [f.name for f in self.functions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two reward functions named {repeated[0]!r}: their metrics fn/<NAME>/... would collide")
        return self


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Log params, metrics and artifacts to MLflow.")
    uri: str | None = Field(
        None,
        description="Tracking URI; None = $MLFLOW_TRACKING_URI, else sqlite:///<output root>/mlflow.db.",
    )
    experiment: str = Field(
        "kubealign", min_length=1, description="Experiment name unless $MLFLOW_EXPERIMENT_NAME/_ID is set."
    )


class Toleration(Section):
    key: str | None = Field(None, description="Taint key to tolerate; None with operator Exists = all taints.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal (key=value) or Exists (key only).")
    value: str | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; None = every effect."
    )


class KubernetesConfig(Section):
    """How the compiled pipeline asks the cluster for resources. Read when compiling / submitting (and by
    the ppo task for multi-node runs); `kubealign run` on a laptop ignores it."""

    accelerator_type: str = Field("nvidia.com/gpu", min_length=1, description="Extended resource of a GPU.")
    sft_gpus: int = Field(1, ge=0, description="GPUs of the sft pod (torchrun nproc = this); 0 = CPU pod.")
    reward_gpus: int = Field(1, ge=0, description="GPUs of the reward pod; 0 = CPU pod.")
    ppo_gpus: int = Field(1, ge=0, description="GPUs per ppo node (pod); 0 = CPU pod.")
    ppo_nodes: int = Field(1, ge=1, description="PPO nodes; > 1 runs PPO as a Kubeflow Trainer TrainJob (needs `pvc`).")
    evaluate_gpus: int = Field(0, ge=0, description="GPUs of the evaluate pod; 0 = CPU pod.")
    cpu_request: str = Field("2", description="CPU request of every task pod (Kubernetes quantity).")
    memory_request: str = Field("8Gi", description="Memory request of the training pods (Kubernetes quantity).")
    shm_size: str = Field("16Gi", description="Size of the /dev/shm memory emptyDir on training pods (NCCL).")
    pvc: str | None = Field(
        None, description="Existing PVC mounted at `pvc_mount` on every task; required when ppo_nodes > 1."
    )
    pvc_mount: str = Field("/mnt/kubealign", description="Mount path of `pvc`.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels for training pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of training pods.")
    mlflow_secret: str | None = Field(
        "kubealign-mlflow",
        description="Secret whose keys become env (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME/PASSWORD ...);"
        " None = none.",
    )
    object_store_secret: str | None = Field(
        "kubealign-object-store",
        description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / MLFLOW_S3_ENDPOINT_URL; None = none.",
    )
    namespace: str = Field("kubeflow", min_length=1, description="Namespace of TrainJobs the ppo task creates.")
    trainjob_runtime: str = Field(
        "kubealign-deepspeed", min_length=1, description="ClusterTrainingRuntime a multi-node TrainJob uses."
    )
    trainjob_timeout_s: float | None = Field(
        None, gt=0, description="Give up on a TrainJob after this many seconds; None = wait as long as it runs."
    )
    train_image: str | None = Field(None, description="Override of the training image (default: kubealign.images).")
    cpu_image: str | None = Field(None, description="Override of the CPU image (default: kubealign.images).")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a failed training task (sft, reward, dpo, ppo): a retried pod resumes from the "
        "task's checkpoints on `pvc`. KFP retries every failure, OOMKilled included (it has no retry policy).",
    )
    retry_backoff: str = Field(
        "60s", pattern=r"^[1-9][0-9]*[smh]$", description="Wait before the first retry (doubles each time)."
    )
    retry_backoff_max: str = Field("30m", pattern=r"^[1-9][0-9]*[smh]$", description="Longest wait between retries.")
    grace_period_s: int = Field(
        120,
        ge=30,
        description="terminationGracePeriodSeconds of the TrainJob's pods: SIGTERM to SIGKILL, time for the last "
        "checkpoint (docs/reliability.md gives save times). KFP cannot set it on its task pods (30 s by default).",
    )
    queue: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        description="Kueue LocalQueue: the `kueue.x-k8s.io/queue-name` label on training pods and the TrainJob.",
    )

    @model_validator(mode="after")
    def _check_multinode(self) -> KubernetesConfig:
        if self.ppo_nodes > 1 and not self.pvc:
            raise ValueError("kubernetes.ppo_nodes > 1 needs kubernetes.pvc (the TrainJob's nodes share it)")
        if self.ppo_nodes > 1 and self.ppo_gpus == 0:
            raise ValueError("kubernetes.ppo_nodes > 1 needs kubernetes.ppo_gpus >= 1")
        return self


class PipelineConfig(Section):
    """What the DAG runs (`kubealign run`, compile, submit); the stages run alone ignore it."""

    algorithm: Literal[ROUTES] = Field(
        "ppo",
        description="The route from SFT to the candidate: ppo, grpo or rloo (the ppo task, with ppo.algorithm set "
        "to it) or dpo (the dpo task on the phase-2 pairs). Evaluate and promote take that candidate.",
    )
    algorithms: list[Literal[ROUTES]] | None = Field(
        None,
        min_length=1,
        description="Several routes compared in one pipeline run (each at most once): every route trains from the "
        "same data-split, SFT and reward tasks, is evaluated against the same SFT baseline, a compare task ranks "
        "them and only the leader can become champion. One entry is the same as `algorithm`; None = `algorithm`.",
    )

    @field_validator("algorithms")
    @classmethod
    def _check_algorithms(cls, value: list[str] | None) -> list[str] | None:
        repeated = sorted({name for name in value or [] if (value or []).count(name) > 1})
        if repeated:
            raise ValueError(f"each route at most once; repeated: {', '.join(repeated)}")
        return value


class KubealignConfig(Section):
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    # The directory of the YAML file this config came from (None: a preset, JSON, or built in code):
    # relative reward-function files are resolved against it. Not a field: not dumped, not hashed.
    _base_dir: str | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> str | None:
        return self._base_dir

    def __eq__(self, other: object) -> bool:
        # equal settings are equal configs, wherever they were read from (pydantic compares private attrs too)
        return isinstance(other, KubealignConfig) and self.model_dump() == other.model_dump()

    def __hash__(self) -> int:
        return hash(self.model_dump_json())

    def route(self) -> str:
        """The DAG's route: pipeline.algorithm, or ppo.algorithm when only that was set (grpo/rloo); with
        several pipeline.algorithms, the first."""
        if self.pipeline.algorithms:
            return self.pipeline.algorithms[0]
        return self.pipeline.algorithm if self.pipeline.algorithm != "ppo" else self.ppo.algorithm

    def routes(self) -> tuple[str, ...]:
        """Every route the DAG trains: pipeline.algorithms, else the one route()."""
        return tuple(self.pipeline.algorithms or ()) or (self.route(),)

    @model_validator(mode="after")
    def _check_cross_fields(self) -> KubealignConfig:
        for name in ("sft", "reward", "dpo"):
            section: TrainConfig = getattr(self, name)
            if section.lora.only_lora and section.lora.r == 0:
                raise ValueError(f"{name}.lora.only_lora needs {name}.lora.r > 0")
        # the DAG sets ppo.algorithm from the route: refuse here what the ppo task would refuse after sft
        if self.pipeline.algorithms and self.pipeline.algorithm != "ppo":
            raise ValueError(
                f"pipeline.algorithm {self.pipeline.algorithm} and pipeline.algorithms both set: keep one "
                "(algorithm is the one-route spelling of algorithms)"
            )
        grouped = [r for r in self.routes() if r in ("grpo", "rloo")]
        if grouped and self.ppo.samples_per_prompt == 1:
            raise ValueError(f"pipeline.algorithm {grouped[0]} needs ppo.samples_per_prompt >= 2 (or unset: 4), got 1")
        return self
