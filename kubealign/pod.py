"""What a task's pod carries: the names of the environment variables the DAG (pipelines/dag.py) sets on a
task's container, and those a task hands on to the pods it starts.

The lowest layer on purpose: the task functions (kubealign.tasks), the stages and the cluster code read these
names, the DAG writes them, and none of them has to import another to agree on a spelling. Nothing from
kubealign is imported here.
"""

from __future__ import annotations

# Pinned when the pipeline is compiled, on the tasks' containers (pipelines/dag.py: Tasks), where a run's
# parameters cannot reach: the sha256 of the reward functions the pipeline embedded (on the tasks that read
# them), and the config sections allowed to run a model's own code (on every task). A run that edits the
# parameters `reward_functions` or `config_json` cannot run other code than what was compiled.
FUNCTIONS_SHA_ENV, REMOTE_CODE_ENV = "KUBEALIGN_REWARD_FUNCTIONS_SHA256", "KUBEALIGN_TRUST_REMOTE_CODE"
REMOTE_CODE_SECTIONS = ("sft", "reward", "dpo")

# Set by the DAG on training tasks when kubernetes.pvc is given (pipelines/dag.py): the checkpoint root on
# the PVC, the pipeline run (the `pipeline/runid` label KFP puts on its pods, through the downward API) and
# the task's name. A retried pod of the same task in the same run gets the same three. The serve task gets
# the run too (it labels the InferenceService with it).
CHECKPOINT_ROOT_ENV, RUN_ID_ENV, TASK_ENV = "KUBEALIGN_CHECKPOINT_ROOT", "KUBEALIGN_RUN_ID", "KUBEALIGN_TASK"

# The task pod's identity, set by the DAG through the downward API (pipelines/dag.py): the TrainJob's owner,
# and the namespace serve applies its InferenceService in.
POD_ENV = {"name": "KUBEALIGN_POD_NAME", "uid": "KUBEALIGN_POD_UID", "namespace": "KUBEALIGN_POD_NAMESPACE"}

# MLflow location and nesting travel from the task's pod into the TrainJob's pods (credentials do not:
# the nodes read them from the Secrets the ppo task's pod reads, the tracking identity and no object store,
# see kubealign.cluster.trainjob.secret_env).
# KUBEALIGN_PARENT_RUN_ID is kubealign.tracking.PARENT_RUN_ENV.
FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
    "KUBEALIGN_PARENT_RUN_ID",
)
