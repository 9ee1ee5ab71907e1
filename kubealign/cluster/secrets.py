"""The keys kubealign reads from the Kubernetes Secrets named in config.kubernetes, as environment
variables of every task pod (pipelines/dag.py) and every TrainJob node (cluster/trainjob.py). All are
optional: a Secret holds the ones its installation needs.

Which Secrets a pod gets: a pod that runs user code (the reward functions: the ppo task of the
ppo / grpo / rloo routes and its TrainJob's nodes, evaluate, and the online judge) gets the tracking identity
(kubernetes.tracking_secret: logs runs, reads the registry, moves nothing) and no object-store keys (the chart's
MLflow proxies artifacts; kubernetes.object_store_user_code for one that does not). Every other pod gets the
pipeline identity (kubernetes.mlflow_secret) and the object store: promote, serve, and the act task that carries
the judge's verdict out (it moves `champion`, so the judge only writes the verdict down)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubealign.config.cluster import KubernetesConfig

MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
OBJECT_STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL")


def pod_secrets(k8s: KubernetesConfig, user_code: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(Secret, its keys) whose keys become env of a pod; user_code: the pod runs the reward functions."""
    mlflow = k8s.tracking_secret if user_code else k8s.mlflow_secret
    store = k8s.object_store_secret if k8s.object_store_user_code or not user_code else None
    return [(name, keys) for name, keys in ((mlflow, MLFLOW_SECRET_KEYS), (store, OBJECT_STORE_SECRET_KEYS)) if name]
