"""The `data` section: where the rows come from (data.sources) and how data-split cuts them into phases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kubealign.config.base import Section

SourceFormat = Literal[
    "auto", "prompt_chosen_rejected", "hh", "prompt_response", "prompt_completion", "messages", "prompt_only"
]


class DataSource(Section):
    path: str = Field(
        description="'synthetic', 'synthetic-arithmetic' or 'synthetic-tool-arithmetic' (built-in generators), a local "
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
    phase: Literal["split", "reward"] = Field(
        "split",
        description="Where this source's prompts go. split: cut by split_ratios with every other source. reward: "
        "each prompt it has a pair for trains the reward model (phase 2's train split), taken out of the other "
        "phases and every eval split, whatever the cut gave it. People's choices (the feedback task's source) go "
        "so: they were asked about held-out prompts the online judge served, which the cut would otherwise keep "
        "in phase 3, where a prompt's pairs are dropped.",
    )


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
    heldout_reward_fraction: float = Field(
        0.25,
        ge=0.0,
        lt=1.0,
        description="Fraction of phase 2's train prompts reserved for the held-out reward model (the reward "
        "task trains it beside the main one; evaluate and promote.guards.min_heldout_win_rate use it as a "
        "scorer the policy was not optimized against). 0 = none (then set that guard to null).",
    )
    people_check_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of the prompts of `phase: reward` sources (people's choices, feedback.project) kept out "
        "of training, by a seeded hash of the prompt (kept out once, kept out as the project grows): the reward task "
        "checks its new model against people on them (people_agreement), and the online judge and promote read that "
        "as the reward model's agreement (promote.guards.min_judge_agreement). 0 = none.",
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
        description="Extra SFT-only (prompt/response) rows of 'synthetic' (of 'synthetic-arithmetic' and "
        "'synthetic-tool-arithmetic': their demonstrations), rows.",
    )
    synthetic_prompts: int = Field(
        500,
        ge=0,
        description="Prompt-only rows {prompt, answer} of 'synthetic-arithmetic' and 'synthetic-tool-arithmetic' "
        "(phase 3 only), rows.",
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
