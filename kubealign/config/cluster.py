"""Where the pipeline runs: the `kubernetes` section (resources, volumes, retries, the queue) and the
`pipeline` section (the routes or candidates the DAG trains)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kubealign.config.base import Section
from kubealign.config.ppo import PPOConfig
from kubealign.config.train import DPOConfig
from kubealign.selection import candidates as sweep
from kubealign.shape import ROUTES


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


class CandidateSpec(Section):
    """One entry of pipeline.candidates: a candidate, or with `sweep` one candidate per point of a grid."""

    name: str | None = Field(
        None,
        description="The candidate's name (its tasks' and MLflow run's); None = the algorithm's. With `sweep`, "
        "the grid points' names start with it: dpo-beta-0p05.",
    )
    algorithm: Literal[ROUTES] = Field(description="The candidate's route: ppo, grpo, rloo or dpo.")
    set: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the route's training section, dotted as in --set: {dpo.beta: 0.05} for dpo, "
        "{ppo.kl_coef: 0.05} for ppo, grpo and rloo. Only that section: every candidate shares the data, SFT, "
        "reward model and evaluation.",
    )
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="A grid: setting -> its values ({dpo.beta: [0.01, 0.05, 0.1]}); one candidate per point of "
        "the product, each with `set` too.",
    )

    @field_validator("sweep")
    @classmethod
    def _check_sweep(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [key for key, values in value.items() if not values]
        if empty:
            raise ValueError(f"sweep {empty[0]}: no values")
        return value


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

    candidates: list[CandidateSpec] | None = Field(
        None,
        min_length=1,
        description="Candidates compared in one run, each a route with its own settings (a sweep expands to "
        "several); like `algorithms`, all share the data-split, SFT and reward tasks and the evaluation, a "
        "compare task ranks them, only the leader can become champion. None = `algorithms` (one candidate "
        "per route, at its section's settings).",
    )
    parallelism: int = Field(
        0,
        ge=0,
        description="At most this many candidates train at once on a cluster (the others wait for a slot); "
        "0 = all at once. kfp.local runs one task at a time anyway.",
    )
    max_kl: float | None = Field(
        None,
        gt=0,
        description="KL budget, nats (evaluate's kl_to_baseline: to the SFT model): the leader is the best "
        "candidate within it; with none within it, nothing is promoted. None = no budget.",
    )

    @field_validator("candidates")
    @classmethod
    def _check_candidates(cls, value: list[CandidateSpec] | None) -> list[CandidateSpec] | None:
        expanded = sweep.expand(spec.model_dump() for spec in value or [])
        sweep.check_names(expanded)
        for candidate in expanded:
            sweep.check_keys(candidate, {"ppo": PPOConfig, "dpo": DPOConfig})
        return value

    def expanded(self) -> list[sweep.Candidate]:
        """pipeline.candidates with every sweep expanded (kubealign.selection.candidates.expand)."""
        return sweep.expand(spec.model_dump() for spec in self.candidates or [])

    @field_validator("algorithms")
    @classmethod
    def _check_algorithms(cls, value: list[str] | None) -> list[str] | None:
        repeated = sorted({name for name in value or [] if (value or []).count(name) > 1})
        if repeated:
            raise ValueError(f"each route at most once; repeated: {', '.join(repeated)}")
        return value
