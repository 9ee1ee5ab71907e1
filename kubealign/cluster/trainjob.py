"""Multi-node PPO as a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1).

When `kubernetes.ppo_nodes > 1`, the ppo KFP task does not train itself: it copies its inputs to the
shared PVC, creates a TrainJob that runs `torchrun -m kubealign.cli ppo ...` on every node (the Trainer's
torch plugin sets the PET_* variables torchrun reads: nnodes, node rank, master address), follows the
first node's log, waits for a terminal condition and maps it onto the task: Complete -> success (the
output is copied back from the PVC into the task's artifact), Failed -> the task fails with the Trainer's
message, over `trainjob_timeout_s` -> the TrainJob is deleted and the task fails.

Preemption: the TrainJob is named after the pipeline run and task, so a retried ppo task finds the one its
predecessor left (a SIGKILLed pod runs no cleanup) and replaces it (`replace_leftover`); its nodes then
resume from the checkpoints on the PVC. It is owned by the task's pod (when both are in one namespace), so
it goes when the run's pods are garbage-collected; a task that stops (SIGTERM, a failure while it waits,
a timeout) deletes it, which gives its nodes `grace_period_s` to checkpoint before SIGKILL.

`manifest()` is pure (tested against ../shared/k8s-schemas); `wait()` and `run()` take the kubernetes API
objects so that a test can drive them with recorded status objects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubealign.cluster.secrets import pod_secrets
from kubealign.config.schema import KubernetesConfig
from kubealign.errors import UserError
from kubealign.pod import POD_ENV  # the task pod's identity: the TrainJob's owner

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
SHM_VOLUME = "dshm"
DATA_VOLUME = "kubealign-data"
TRAINER_JOB = "node"  # the replicated job name of the torch ClusterTrainingRuntime the chart ships
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


class TrainJobFailed(RuntimeError):
    """The TrainJob ended Failed, or ran past its timeout."""


def manifest(
    name: str,
    k8s: KubernetesConfig,
    image: str,
    command: list[str],
    env: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The TrainJob for `command` on k8s.ppo_nodes nodes x k8s.ppo_gpus GPUs, sharing k8s.pvc; `owners`: its
    ownerReferences (owner_references)."""
    resources = {
        "requests": {"cpu": k8s.cpu_request, "memory": k8s.memory_request, k8s.accelerator_type: str(k8s.ppo_gpus)},
        "limits": {k8s.accelerator_type: str(k8s.ppo_gpus)},
    }
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": k8s.grace_period_s,  # SIGTERM -> the last checkpoint -> exit
        "volumes": [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}},
            {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": k8s.pvc}},
        ],
        "containers": [
            {
                "name": TRAINER_JOB,
                "volumeMounts": [
                    {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
                    {"name": DATA_VOLUME, "mountPath": k8s.pvc_mount},
                ],
            }
        ],
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in k8s.tolerations]
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": k8s.namespace,
        "labels": {"app.kubernetes.io/part-of": "kubealign"} | ({QUEUE_LABEL: k8s.queue} if k8s.queue else {}),
    }
    if owners:
        metadata["ownerReferences"] = owners
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": k8s.trainjob_runtime, "kind": "ClusterTrainingRuntime", "apiGroup": GROUP},
            "trainer": {
                "image": image,
                "command": command,
                "numNodes": k8s.ppo_nodes,
                "numProcPerNode": k8s.ppo_gpus,
                "resourcesPerNode": resources,
                "env": [{"name": key, "value": value} for key, value in sorted((env or {}).items())] + secret_env(k8s),
            },
            "runtimePatches": [
                {
                    "manager": "kubealign",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": TRAINER_JOB, "template": {"spec": {"template": {"spec": pod_spec}}}}
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def owner_references(env: dict[str, str], namespace: str) -> list[dict[str, Any]]:
    """The task pod as the TrainJob's owner, from the downward-API variables (POD_ENV). None when they are
    absent, or when the pod is in another namespace: Kubernetes has no cross-namespace owners, and its
    garbage collector would delete a TrainJob whose owner it cannot find in the TrainJob's namespace."""
    name, uid, pod_namespace = (env.get(POD_ENV[key], "") for key in ("name", "uid", "namespace"))
    if not (name and uid) or pod_namespace != namespace:
        return []
    return [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False}]


def secret_env(k8s: KubernetesConfig) -> list[dict[str, Any]]:
    """The Secret keys the ppo task's own pod gets (it runs the reward functions: the tracking identity, no
    object store unless kubernetes.object_store_user_code), as secretKeyRefs (never as values copied into the
    TrainJob object)."""
    refs = []
    for secret, keys in pod_secrets(k8s, user_code=True):
        for key in keys:
            ref = {"name": secret, "key": key, "optional": True}
            refs.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return refs


def terminal_state(trainjob: dict[str, Any]) -> tuple[str, str] | None:
    """('Complete'|'Failed', message) once a condition of that type is True; None while running."""
    for condition in (trainjob.get("status") or {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"], condition.get("message") or condition.get("reason") or ""
    return None


def wait(
    custom: Any,
    name: str,
    namespace: str,
    timeout_s: float | None,
    poll_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Poll the TrainJob until Complete (returns its message) or Failed / past timeout (raises).

    `custom` is a kubernetes.client.CustomObjectsApi. A timeout deletes the TrainJob so that its GPUs
    are released; there is no built-in cap: None waits as long as the job runs (the KFP task's own
    timeout, if any, still applies).
    """
    start = clock()
    while True:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        state = terminal_state(job)
        if state is not None:
            kind, message = state
            if kind == "Failed":
                raise TrainJobFailed(f"TrainJob {namespace}/{name} failed: {message}")
            return message
        if timeout_s is not None and clock() - start > timeout_s:
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            raise TrainJobFailed(f"TrainJob {namespace}/{name} still running after {timeout_s:.0f} s; deleted it")
        sleep(poll_s)


def follow_logs(core: Any, name: str, namespace: str, write: Callable[[str], None] = print) -> threading.Thread:
    """Stream the first node's log into this task's log (daemon thread; ends with the pod)."""

    def run() -> None:
        selector = f"jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0"
        for _ in range(120):  # the pod appears once the JobSet is admitted
            pods = core.list_namespaced_pod(namespace, label_selector=selector).items
            if pods and pods[0].status.phase in ("Running", "Succeeded", "Failed"):
                stream = core.read_namespaced_pod_log(
                    pods[0].metadata.name, namespace, container=TRAINER_JOB, follow=True, _preload_content=False
                )
                for line in stream:
                    write(line.decode(errors="replace").rstrip("\n"))
                return
            time.sleep(5)

    thread = threading.Thread(target=run, name=f"logs-{name}", daemon=True)
    thread.start()
    return thread


def _exists(custom: Any, name: str, namespace: str) -> bool:
    """Whether the TrainJob is there (a 404 says no; any other API error is raised)."""
    try:
        custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except Exception as exc:
        if getattr(exc, "status", None) == 404:
            return False
        raise
    return True


def replace_leftover(
    custom: Any,
    name: str,
    namespace: str,
    timeout_s: float,
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Delete the TrainJob NAME that an earlier try of this task left (running or ended) and wait until it is
    gone, so that a new one of the same name can be created; True if there was one."""
    if not _exists(custom, name, namespace):
        return False
    print(f"replacing TrainJob {namespace}/{name}, left by an earlier try of this task", flush=True)
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    start = clock()
    while clock() - start <= timeout_s:
        if not _exists(custom, name, namespace):
            return True
        sleep(poll_s)
    raise TrainJobFailed(
        f"TrainJob {namespace}/{name}, left by an earlier try, still exists {timeout_s:.0f} s after its deletion"
    )


def run(
    custom: Any,
    core: Any,
    body: dict[str, Any],
    timeout_s: float | None,
    poll_s: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Create the TrainJob, follow its log, wait for its end (wait). Whatever stops the wait before the end (a
    SIGTERM raised as Stopped, an API error) deletes the TrainJob: its GPUs are freed and its nodes checkpoint
    within their grace period. A TrainJob that ended Failed stays for inspection (a retry replaces it)."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    print(f"created TrainJob {namespace}/{name}: {body['spec']['trainer']['numNodes']} nodes", flush=True)
    if core is not None:
        follow_logs(core, name, namespace)
    ended = False
    try:
        message = wait(custom, name, namespace, timeout_s, poll_s=poll_s, sleep=sleep)
        ended = True
        return message
    except TrainJobFailed:
        ended = True  # wait() deleted a timed-out job itself; a Failed one is kept
        raise
    finally:
        if not ended:
            try:
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                print(f"deleted TrainJob {namespace}/{name}", flush=True)
            except Exception as exc:  # noqa: BLE001 - already gone, or the API is down: the owner reference remains
                print(f"could not delete TrainJob {namespace}/{name}: {exc}", flush=True)


def connect() -> tuple[Any, Any]:
    """(CustomObjectsApi, CoreV1Api) of the cluster this pod runs in (else the developer's kubeconfig)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise UserError(f"no Kubernetes cluster: not in a pod, and no usable kubeconfig ({exc})") from None
    return client.CustomObjectsApi(), client.CoreV1Api()
