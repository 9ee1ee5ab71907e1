"""Typed, frozen configuration: one section per stage, one YAML file for all of them.

Every field has a default and a description with its unit. Models forbid unknown keys, so a typo in
a YAML file or a --set override is an error that names the field instead of a silently ignored knob.
Training fields follow DeepSpeed-Chat's flags; the `kubernetes` section is read only where the pipeline is
compiled (and by the ppo task for a multi-node TrainJob).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from kubealign.config.base import DType, Section
from kubealign.config.canary import CanaryConfig
from kubealign.config.candidates import Candidate
from kubealign.config.cluster import KubernetesConfig, Toleration
from kubealign.config.data import DataConfig, DataSource
from kubealign.config.feedback import FeedbackConfig
from kubealign.config.guards import GuardsConfig
from kubealign.config.llm_judge import LLMJudgeConfig
from kubealign.config.pipeline import PipelineConfig, shorthand
from kubealign.config.ppo import HybridEngineConfig, PPOConfig, RolloutCorrectionConfig
from kubealign.config.serve import ServeConfig
from kubealign.config.suites import SuitesConfig
from kubealign.config.tools import ToolsConfig, check_reference
from kubealign.config.train import DPOConfig, LoraConfig, RewardConfig, SFTConfig, TrainConfig

# the sections' classes live by concept (base, data, train, ppo, cluster, pipeline, ...); importable from here
__all__ = [
    "DPOConfig",
    "DType",
    "DataConfig",
    "DataSource",
    "EvaluateConfig",
    "GuardsConfig",
    "HybridEngineConfig",
    "KubealignConfig",
    "KubernetesConfig",
    "LoraConfig",
    "PPOConfig",
    "PipelineConfig",
    "PromoteConfig",
    "RewardConfig",
    "RewardFunction",
    "RewardsConfig",
    "RolloutCorrectionConfig",
    "SFTConfig",
    "Section",
    "Toleration",
    "TrackingConfig",
    "TrainConfig",
]


class EvaluateConfig(Section):
    max_prompts: int = Field(64, ge=1, description="Phase-3 eval prompts to generate for.")
    batch_size: int = Field(8, ge=1, description="Prompts per generation batch.")
    max_new_tokens: int = Field(32, ge=1, description="Response cap, tokens.")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature (same for both models).")
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables (not the model's default of 50).")
    seed: int = Field(1234, description="Sampling seed shared by baseline and candidate.")
    sample_rows: int = Field(20, ge=0, description="Rows in the HTML/Markdown sample table.")
    llm_judge: LLMJudgeConfig = Field(
        default_factory=LLMJudgeConfig,
        description="An LLM behind an OpenAI-compatible endpoint that compares both models' answers, in both "
        "orders, in evaluate and in the online judge (kubealign.config.llm_judge; docs/guards.md). Off by default "
        "(url None).",
    )
    suites: SuitesConfig = Field(
        default_factory=SuitesConfig,
        description="Benchmark suites through lm-eval-harness, both models on each (kubealign.config.suites; "
        "docs/guards.md). Off by default (no task).",
    )


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
    tie_credit: float = Field(
        0.0,
        ge=0,
        le=1,
        description="What a tie counts for in the gate's win-rates (the reward model's, min_win_rate, and the "
        "held-out one's, min_heldout_win_rate): 0 a loss, 0.5 half a win, as AlpacaEval and Chatbot Arena count "
        "ties. Two models that often answer alike (greedy decoding, close checkpoints: the online judge) tie on "
        "many prompts, and a bar on strict wins then measures how often they differ. The lower bound stays of "
        "strict wins.",
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
    guards: GuardsConfig = Field(
        default_factory=GuardsConfig,
        description="What the gate asks besides the reward it was trained on: held-out capability and no "
        "degenerate answers, against the baseline (kubealign.config.guards; docs/guards.md). On by default.",
    )
    mode: Literal["direct", "canary"] = Field(
        "direct",
        description="direct: a candidate that passes the gate becomes champion. canary: it becomes challenger only, "
        "to be served beside the champion and judged online; champion stays (a first version, with no "
        "champion to be judged against, becomes champion directly).",
    )

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
        return check_reference(value, "NAME")

    @property
    def name(self) -> str:
        """The function's name (what metrics fn/<NAME>/... and errors call it)."""
        return self.path.rpartition(":")[2]


class RewardsConfig(Section):
    """What scores a response in ppo / grpo / rloo and in evaluate: the reward model, reward functions as code
        (verifiable rewards), or both. Functions are the user's own code: they run in a worker process with a scrubbed
    environment, a private working directory (the only place they may write), a memory and a file-size limit, a
    timeout and no network by default (kubealign.usercode.runner, kubealign.usercode.sandbox)."""

    functions: list[RewardFunction] = Field(default_factory=list, description="Reward functions, in order.")
    model_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the reward model's score; 0 with functions = no reward model at all (the reward "
        "stage is skipped in the DAG, ppo's critic starts from the SFT model with a new value head).",
    )
    timeout_s: float = Field(60.0, gt=0, description="Per-call limit of one reward function on one batch, s.")
    memory_limit_mb: int = Field(
        4096,
        ge=256,
        description="Memory of the reward-function worker, MiB: the address space of each of its processes "
        "(past it an allocation fails and the call is one line) and what its processes hold together (their "
        "proportional set size, read every 0.25 s by the trainer: past it the tree is stopped with one line). The "
        "worker is also the OOM killer's first choice.",
    )
    worker_env: list[str] = Field(
        default_factory=list,
        description="Environment variables the reward-function worker gets besides PATH, LANG, LC_*, TZ and "
        "PYTHONPATH (e.g. a judge API's key). None of the task's credentials by default.",
    )
    file_limit_mb: int = Field(
        1024,
        ge=1,
        description="Largest file the reward-function worker may write, MiB (RLIMIT_FSIZE): a write past it fails "
        "and the function's call is one line.",
    )
    network: bool = Field(
        False,
        description="Let reward functions, tools and environments open sockets (e.g. to a judge API). Off: TCP "
        "connect and bind are refused by Landlock (ABI >= 4), and socket(2) by a seccomp filter for every family "
        "but netlink routing (UDP, unix sockets by path, raw), socketpair(2) but for unix stream pairs.",
    )
    max_processes: int = Field(
        64,
        ge=1,
        description="Processes the reward-function worker's code (reward functions, tools, an environment) may run "
        "at once besides the worker, detached ones included: past it the whole tree is stopped with one line. "
        "The trainer counts them every 0.25 s; the worker's RLIMIT_NPROC (its uid's tasks at its start + this + 8, "
        "threads included; not for uid 0) refuses a fork past it sooner.",
    )

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


class KubealignConfig(Section):
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
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
        """The DAG's route: the first candidate's (pipeline.candidates), else ppo.algorithm's (ppo unless set)."""
        if self.pipeline.candidates:
            return self.pipeline.expanded()[0].route
        return self.ppo.algorithm

    def candidates(self) -> tuple[Candidate, ...]:
        """Every candidate the DAG trains: pipeline.candidates (sweeps expanded; the deprecated
        pipeline.algorithm(s) are read as candidates, kubealign.config.pipeline.shorthand), else the one
        route() named after itself, with no settings."""
        if self.pipeline.candidates:
            return tuple(self.pipeline.expanded())
        return (Candidate(self.route(), self.route(), {}),)

    def candidate_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.candidates())

    def routes(self) -> tuple[str, ...]:
        """Every route the DAG trains (once each, in the candidates' order)."""
        return tuple(dict.fromkeys(c.route for c in self.candidates()))

    def several(self) -> bool:
        """Whether the DAG compares candidates (a branch each, a compare task) or runs one route."""
        return len(self.candidates()) > 1

    def for_candidate(self, candidate: Candidate) -> KubealignConfig:
        """This config as `candidate`'s one-route run: its settings applied, the route its own."""
        data = self.model_dump(mode="json")
        data["pipeline"] = {"candidates": [{"route": candidate.route}]}
        if candidate.route != "dpo":
            data["ppo"]["algorithm"] = candidate.route
        for key, value in candidate.settings.items():
            *path, leaf = key.split(".")
            node = data
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
        resolved = KubealignConfig.model_validate(data)
        resolved._base_dir = self._base_dir
        return resolved

    @model_validator(mode="before")
    @classmethod
    def _read_shorthand(cls, data: object) -> object:
        """pipeline.algorithm(s), the deprecated spellings, read as pipeline.candidates (a conflict is an error
        across fields: its message names them)."""
        if isinstance(data, dict) and isinstance(data.get("pipeline"), dict):
            return {**data, "pipeline": shorthand(data["pipeline"])}
        return data

    @model_validator(mode="after")
    def _check_cross_fields(self) -> KubealignConfig:
        for name in ("sft", "reward", "dpo"):
            section: TrainConfig = getattr(self, name)
            if section.lora.only_lora and section.lora.r == 0:
                raise ValueError(f"{name}.lora.only_lora needs {name}.lora.r > 0")
        if self.serve.enabled and self.several():
            raise ValueError(
                "serve.enabled takes one route: with several pipeline.candidates, serve the champion "
                "with `kubealign serve --manifest` after the run"
            )
        if self.tools.enabled and self.ppo.rollout_correction.kind != "none":
            raise ValueError(
                "ppo.rollout_correction needs the rollout's own log-probs, which multi-turn rollouts (tools) do not "
                "record yet: set ppo.rollout_correction.kind=none or remove the tools"
            )
        self._check_candidates()
        return self

    def _check_candidates(self) -> None:
        """Each candidate validated as its own run's config would be (its settings' bounds, cross-field rules,
        the ppo task's with ppo.algorithm set to its route): refused here, not by the ppo task after sft."""
        for candidate in self.candidates():
            if not candidate.settings and candidate.route in ("dpo", self.ppo.algorithm):
                continue  # this config is its run's already (and for_candidate's own config ends here)
            try:
                self.for_candidate(candidate)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                where = f"field '{field}': " if field else ""
                message = str(err["msg"]).removeprefix("Value error, ")
                raise ValueError(f"pipeline.candidates: candidate {candidate.name}: {where}{message}") from None
