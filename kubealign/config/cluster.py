"""Where the pipeline runs: the `kubernetes` section (resources, volumes, retries, the queue). What it
trains, the `pipeline` section, is kubealign.config.pipeline's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kubealign.config.base import Section


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
    tracking_secret: str | None = Field(
        "kubealign-mlflow-tracker",
        description="Secret with the same MLflow keys for the pods that run user code (the reward functions: "
        "ppo / grpo / rloo and their TrainJob nodes, evaluate, the online judge) instead of "
        "`mlflow_secret`: an identity that logs runs but cannot register versions or move aliases (the chart's "
        "tracker). None = none; the name of `mlflow_secret` = the pipeline identity there too.",
    )
    object_store_secret: str | None = Field(
        "kubealign-object-store",
        description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / MLFLOW_S3_ENDPOINT_URL, on the pods that "
        "run no user code (and on those too with `object_store_user_code`); None = none.",
    )
    object_store_user_code: bool = Field(
        False,
        description="Give `object_store_secret` to the pods that run user code too. Only for an MLflow that does "
        "not proxy artifacts (no --serve-artifacts), whose clients write to the bucket themselves; the chart's "
        "MLflow proxies them.",
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
