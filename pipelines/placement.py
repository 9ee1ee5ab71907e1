"""Where a task runs on the cluster: its image, requests, accelerators, /dev/shm, node placement, Secrets, PVC
and, for a training task, what lets it survive a preemption. Everything here is read from `config.kubernetes`
and set on the pipeline's tasks (kubealign.pipelines.dag), never in the components.
"""

from kfp import dsl, kubernetes

from kubealign import pod
from kubealign.cluster import trainjob
from kubealign.cluster.secrets import pod_secrets
from kubealign.config.schema import KubernetesConfig


def resources(
    task: dsl.PipelineTask,
    k8s: KubernetesConfig,
    gpus: int,
    image: str,
    training: bool,
    user_code: bool = False,
    identity: bool = True,
) -> None:
    """Image, requests, accelerators, shm, node placement, secrets and PVC of one task. user_code: the task runs
    the reward functions, and gets the tracking identity and no object store (kubealign.cluster.secrets); identity
    False: neither MLflow nor the object store (a task that needs neither)."""
    task.set_container_image(image)
    task.set_cpu_request(k8s.cpu_request)
    if training:
        task.set_memory_request(k8s.memory_request)
        # NCCL and DataLoader workers need more shared memory than the container runtime's 64 MiB.
        kubernetes.empty_dir_mount(task, "dshm", "/dev/shm", medium="Memory", size_limit=k8s.shm_size)
    if gpus:
        task.set_accelerator_type(k8s.accelerator_type).set_accelerator_limit(gpus)
        for key, value in k8s.node_selector.items():
            kubernetes.add_node_selector(task, key, value)
        for tol in k8s.tolerations:
            kubernetes.add_toleration(task, key=tol.key, operator=tol.operator, value=tol.value, effect=tol.effect)
    for secret, keys in pod_secrets(k8s, user_code) if identity else []:
        kubernetes.use_secret_as_env(task, secret, {key: key for key in keys}, optional=True)
    if k8s.pvc:
        kubernetes.mount_pvc(task, k8s.pvc, k8s.pvc_mount)
    if training:
        preemptible(task, k8s)


def preemptible(task: dsl.PipelineTask, k8s: KubernetesConfig) -> None:
    """A training task survives a preemption: retried with a backoff, and (with a PVC) its checkpoints kept
    on the PVC under the run and the task, where the retried pod finds them and resumes
    (kubealign.tasks.launch.checkpoint_location). None of this is in KFP's cache key (env and retry are not),
    so cached runs stay cached. The downward API gives the run (KFP labels its pods `pipeline/runid`) and the
    pod's identity (the owner of a multi-node TrainJob); the names are kubealign.pod's."""
    if k8s.retries:
        task.set_retry(
            k8s.retries,
            backoff_duration=k8s.retry_backoff,
            backoff_factor=2.0,
            backoff_max_duration=k8s.retry_backoff_max,
        )
    if k8s.queue:
        kubernetes.add_pod_label(task, trainjob.QUEUE_LABEL, k8s.queue)
    if k8s.pvc:
        task.set_env_variable(pod.CHECKPOINT_ROOT_ENV, f"{k8s.pvc_mount}/checkpoints")
        task.set_env_variable(pod.TASK_ENV, task.name)
        kubernetes.use_field_path_as_env(task, pod.RUN_ID_ENV, "metadata.labels['pipeline/runid']")
    for key, env_name in pod.POD_ENV.items():
        kubernetes.use_field_path_as_env(task, env_name, f"metadata.{key}")
