"""The training sections of the loop stages (sft, reward, dpo) and LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kubealign.config.base import DType, Section


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
    revision: str | None = Field(
        None,
        description="Hub revision of `model` (branch, tag or commit; None = main). A compiled pipeline pins it to "
        "the commit it names then (kubealign.models.hub).",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    offload: bool = Field(False, description="Offload optimizer state and (ZeRO-3) params to CPU.")
    dtype: DType = Field("fp32", description="Training precision; fp32 on CPU.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    fp32_loss: bool = Field(True, description="Compute the loss from fp32-upcast logits under bf16/fp16.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per device per micro-step.")
    batching: Literal["grouped", "padded"] = Field(
        "grouped",
        description="grouped: micro-batches of similar lengths (little padding; kubealign.data.batching); "
        "padded: plain shuffled batches, each padded to its longest.",
    )
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
