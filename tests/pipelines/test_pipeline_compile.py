"""The compiled DAG: KFP IR that parses into the PipelineSpec proto, with the tasks, edges, GPUs,
secrets, volumes and cache-relevant inputs the cluster needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb
from kfp.pipeline_spec import pipeline_spec_pb2

from kubealign.config import load_config
from kubealign.pipelines.remote import compile_pipeline
from tests.conftest import write_jsonl

pytestmark = pytest.mark.kfp
PINS = {"KUBEALIGN_REWARD_FUNCTIONS_SHA256", "KUBEALIGN_TRUST_REMOTE_CODE"}  # on every task: tasks.pins

GPU_CLUSTER = [
    "kubernetes.sft_gpus=2",
    "kubernetes.reward_gpus=1",
    "kubernetes.ppo_gpus=8",
    "kubernetes.pvc=rlhf-data",
    "kubernetes.node_selector={pool: a100}",
    "kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
    "kubernetes.shm_size=32Gi",
]
GRPO_DPO = "pipeline.candidates=[{route: grpo}, {route: dpo}]"


def compiled(
    tmp_path: Path, overrides: list[str]
) -> tuple[pipeline_spec_pb2.PipelineSpec, k8s_pb.KubernetesExecutorConfig]:
    path = compile_pipeline(load_config(None, overrides), tmp_path / "pipeline.yaml")
    pipeline_doc, platform_doc = yaml.safe_load_all(path.read_text(encoding="utf-8"))
    spec = json_format.ParseDict(pipeline_doc, pipeline_spec_pb2.PipelineSpec())
    executors = platform_doc["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return spec, {
        name: json_format.ParseDict(cfg, k8s_pb.KubernetesExecutorConfig()) for name, cfg in executors.items()
    }


def test_tasks_routes_and_edges(tmp_path: Path) -> None:
    spec, _ = compiled(tmp_path, [])
    tasks = spec.root.dag.tasks
    assert set(tasks) == {"data-split", "sft", "reward", "condition-branches-1", "evaluate", "promote"}

    def producers(task: str, dag=spec.root.dag) -> set[str]:
        inputs = dag.tasks[task].inputs.artifacts.values()
        return {a.task_output_artifact.producer_task or a.component_input_artifact for a in inputs}

    assert producers("sft") == producers("reward") == {"data-split"}  # sft || reward
    assert producers("condition-branches-1") == {"data-split", "sft", "reward"}
    assert producers("evaluate") == {"data-split", "sft", "reward", "condition-branches-1"}
    assert producers("promote") == {"evaluate", "condition-branches-1"}
    # the two routes: dpo when algorithm == 'dpo', else the ppo task (ppo, grpo, rloo)
    components = spec.components
    branches = components["comp-condition-branches-1"].dag.tasks
    conditions = {t.component_ref.name: t.trigger_policy.condition for t in branches.values()}
    dpo_when = "inputs.parameter_values['pipelinechannel--algorithm'] == 'dpo'"
    assert conditions == {"comp-condition-2": dpo_when, "comp-condition-3": f"!({dpo_when})"}
    assert set(components["comp-condition-2"].dag.tasks) == {"dpo"}
    assert set(components["comp-condition-3"].dag.tasks) == {"ppo"}
    # evaluate and promote take the one candidate the route made (dsl.OneOf over both branches)
    oneof = components["comp-condition-branches-1"].dag.outputs.artifacts[
        "pipelinechannel--condition-branches-1-oneof-1"
    ]
    assert [(s.producer_subtask, s.output_artifact_key) for s in oneof.artifact_selectors] == [
        ("condition-2", "pipelinechannel--dpo-model"),
        ("condition-3", "pipelinechannel--ppo-model"),
    ]
    for consumer in ("evaluate", "promote"):
        candidate = tasks[consumer].inputs.artifacts["candidate"].task_output_artifact
        assert (candidate.producer_task, candidate.output_artifact_key) == (
            "condition-branches-1",
            "pipelinechannel--condition-branches-1-oneof-1",
        )
    ppo = components["comp-condition-3"].dag.tasks["ppo"]
    assert ppo.task_info.name == "PPO / GRPO / RLOO (hybrid engine)"
    assert ppo.inputs.parameters["algorithm"].component_input_parameter == "pipelinechannel--algorithm"
    # the pipeline parameters and their defaults: the resolved config and the common knobs
    params = spec.root.input_definitions.parameters
    assert set(params) >= {
        "config_json",
        "algorithm",
        "sft_model",
        "reward_model",
        "ppo_num_iterations",
        "data_fingerprint",
    }
    assert params["algorithm"].default_value.string_value == "ppo"
    assert params["ppo_num_iterations"].default_value.number_value == 30  # tiny-cpu's ppo.num_iterations
    # promote always re-checks the registry; the other tasks may be served from KFP's cache
    assert not tasks["promote"].caching_options.enable_cache
    assert tasks["sft"].caching_options.enable_cache


def test_the_algorithm_parameter_defaults_to_the_config(tmp_path: Path) -> None:
    spec, _ = compiled(tmp_path, ["pipeline.candidates=[{route: grpo}]"])
    assert spec.root.input_definitions.parameters["algorithm"].default_value.string_value == "grpo"


def test_gpus_shm_secrets_pvc_and_placement_are_set_in_the_pipeline(tmp_path: Path) -> None:
    spec, platform = compiled(tmp_path, GPU_CLUSTER)
    executors = json_format.MessageToDict(spec.deployment_spec)["executors"]
    containers = {name: executors[f"exec-{name}"]["container"] for name in ("sft", "reward", "ppo", "data-split")}
    gpus = {name: c.get("resources", {}).get("accelerator", {}) for name, c in containers.items()}
    assert (gpus["sft"]["resourceCount"], gpus["sft"]["resourceType"]) == ("2", "nvidia.com/gpu")
    assert gpus["reward"]["resourceCount"] == "1"
    assert gpus["ppo"]["resourceCount"] == "8"
    assert gpus["data-split"] == {}  # CPU task
    assert containers["sft"]["image"].endswith(":0.1.0") and "kubealign-train" in containers["sft"]["image"]
    assert "kubealign-cpu" in containers["data-split"]["image"]

    ppo = platform["exec-ppo"]
    assert [(v.mount_path, v.medium, v.size_limit) for v in ppo.empty_dir_mounts] == [("/dev/shm", "Memory", "32Gi")]
    assert [(p.constant, p.mount_path) for p in ppo.pvc_mount] == [("rlhf-data", "/mnt/kubealign")]
    assert dict(ppo.node_selector.labels) == {"pool": "a100"}
    assert [(t.key, t.operator, t.effect) for t in ppo.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
    secrets = {s.secret_name: {k.env_var for k in s.key_to_env} for s in ppo.secret_as_env}
    # ppo runs the reward functions: the tracking identity, no object store (test_secrets_follow_user_code)
    assert secrets == {
        "kubealign-mlflow-tracker": {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    }
    # no shm, GPUs or node pinning for the CPU-only data split; the pipeline identity and the object store
    split = platform["exec-data-split"]
    assert not split.empty_dir_mounts and not split.node_selector.labels
    secrets = {s.secret_name: {k.env_var for k in s.key_to_env} for s in split.secret_as_env}
    assert secrets["kubealign-mlflow"] == {
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
    }
    assert "AWS_SECRET_ACCESS_KEY" in secrets["kubealign-object-store"]


PIPELINE, TRACKER, STORE = "kubealign-mlflow", "kubealign-mlflow-tracker", "kubealign-object-store"


def secret_names(platform: dict, executor: str) -> set[str]:
    return {s.secret_name for s in platform[f"exec-{executor}"].secret_as_env}


def test_secrets_follow_user_code(tmp_path: Path) -> None:
    """Issue 54: the pods that run the reward functions (the route's training task, evaluate, the online judge)
    get the tracking identity and no object store; every other pod, promote above all, the pipeline identity (it
    registers versions and moves `champion`) and the object store: the act task that carries the judge's verdict
    out too, and only with canary.act."""
    trusted = {PIPELINE, STORE}
    _, platform = compiled(tmp_path, ["serve.enabled=true", "promote.mode=canary"])
    assert set(platform) == {
        f"exec-{t}"
        for t in ("data-split", "sft", "reward", "ppo", "dpo", "evaluate", "promote", "serve", "judge", "act")
    }
    for task in ("data-split", "sft", "reward", "dpo", "promote", "serve", "act"):  # act: moves the aliases
        assert secret_names(platform, task) == trusted, task
    for task in ("ppo", "evaluate", "judge"):  # judge: scores with the reward functions, moves nothing
        assert secret_names(platform, task) == {TRACKER}, task
    _, platform = compiled(tmp_path, ["serve.enabled=true", "promote.mode=canary", "canary.act=false"])
    assert secret_names(platform, "judge") == {TRACKER} and "exec-act" not in platform  # it only reports
    assert secret_names(platform, "serve") == trusted
    # several candidates: each route's training task and evaluate are user code; compare and promote are not
    _, platform = compiled(tmp_path, [GRPO_DPO])
    for task in ("grpo", "evaluate-grpo", "evaluate-dpo"):
        assert secret_names(platform, task) == {TRACKER}, task
    for task in ("dpo", "compare", "promote-grpo", "promote-dpo", "data-split"):
        assert secret_names(platform, task) == trusted, task
    # an MLflow that does not proxy artifacts: the object store on the user-code pods, asked for by name
    _, platform = compiled(tmp_path, ["kubernetes.object_store_user_code=true"])
    assert secret_names(platform, "ppo") == secret_names(platform, "evaluate") == {TRACKER, STORE}
    _, platform = compiled(tmp_path, ["kubernetes.tracking_secret=null", "kubernetes.object_store_secret=null"])
    assert secret_names(platform, "ppo") == set() and secret_names(platform, "promote") == {PIPELINE}


def test_components_hold_no_install_step(tmp_path: Path) -> None:
    spec, _ = compiled(tmp_path, [])
    for name, executor in json_format.MessageToDict(spec.deployment_spec)["executors"].items():
        command = " ".join(executor["container"]["command"])
        assert "pip install" not in command, name
        assert "kubealign import tasks" in command, name  # the body is a call into kubealign.tasks


def test_data_fingerprint_follows_the_content_of_a_local_source(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    overrides = [f"data.sources=[{{path: {source}}}]"]

    def fingerprint() -> str:
        spec, _ = compiled(tmp_path, overrides)
        return spec.root.input_definitions.parameters["data_fingerprint"].default_value.string_value

    first, again = fingerprint(), fingerprint()
    write_jsonl(source, [{"prompt": "p", "chosen": "a", "rejected": "c"}])  # same path, new content
    assert first == again
    assert fingerprint() != first  # so KFP's cache cannot serve the old split for the new data


def test_compile_cli_and_bad_config(cli, tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"
    result = cli("compile", "--set", "kubernetes.ppo_gpus=4", "-o", out)
    assert result.code == 0 and out.is_file(), result.err
    bad = cli("compile", "--set", "kubernetes.ppo_nodes=2", "-o", tmp_path / "q.yaml")
    assert bad.code == 2 and "kubernetes.pvc" in bad.err and len(bad.err.strip().splitlines()) == 1
    assert not (tmp_path / "q.yaml").exists()


def test_training_tasks_retry_keep_checkpoints_on_the_pvc_and_join_the_queue(tmp_path: Path) -> None:
    """Preemption on the cluster: every training task (and only those) retries with a backoff, keeps its
    checkpoints on the PVC under the run (the pod's `pipeline/runid` label) and its task name, knows its pod
    (a TrainJob's owner), and carries the Kueue queue label."""
    overrides = [*GPU_CLUSTER, "kubernetes.queue=team-a", "kubernetes.retries=3", GRPO_DPO]
    spec, platform = compiled(tmp_path, overrides)
    tasks = json_format.MessageToDict(spec.root.dag)["tasks"]
    training = {"sft", "reward", "grpo", "dpo"}
    assert {name for name, task in tasks.items() if "retryPolicy" in task} == training
    assert tasks["grpo"]["retryPolicy"] == {
        "maxRetryCount": 3,
        "backoffDuration": "60s",
        "backoffFactor": 2.0,
        "backoffMaxDuration": "1800s",
    }
    executors = json_format.MessageToDict(spec.deployment_spec)["executors"]

    def env_of(name: str) -> dict[str, str]:  # without what every task gets (the compile-time pins)
        env = {e["name"]: e.get("value", "") for e in executors[f"exec-{name}"]["container"]["env"]}
        return {k: v for k, v in env.items() if k not in PINS}

    for name in training:
        env = env_of(name)
        assert env == {"KUBEALIGN_CHECKPOINT_ROOT": "/mnt/kubealign/checkpoints", "KUBEALIGN_TASK": name}
        fields = {f.name: f.field_path for f in platform[f"exec-{name}"].field_path_as_env}
        assert fields == {
            "KUBEALIGN_RUN_ID": "metadata.labels['pipeline/runid']",
            "KUBEALIGN_POD_NAME": "metadata.name",
            "KUBEALIGN_POD_UID": "metadata.uid",
            "KUBEALIGN_POD_NAMESPACE": "metadata.namespace",
        }
        assert dict(platform[f"exec-{name}"].pod_metadata.labels) == {"kueue.x-k8s.io/queue-name": "team-a"}
    for name in ("data-split", "evaluate-grpo", "compare", "promote-dpo"):
        assert env_of(name) == {} and not platform[f"exec-{name}"].field_path_as_env
    # no PVC: the checkpoints stay beside the output (nothing to find after a retry), and no queue, no retry
    spec, platform = compiled(tmp_path, ["kubernetes.retries=0"])
    assert not any("retryPolicy" in t for t in json_format.MessageToDict(spec.root.dag)["tasks"].values())
    container = json_format.MessageToDict(spec.deployment_spec)["executors"]["exec-sft"]["container"]
    assert {e["name"] for e in container["env"]} == PINS - {"KUBEALIGN_REWARD_FUNCTIONS_SHA256"}
    assert not platform["exec-sft"].pod_metadata.labels
    assert [f.name for f in platform["exec-sft"].field_path_as_env] == [
        "KUBEALIGN_POD_NAME",
        "KUBEALIGN_POD_UID",
        "KUBEALIGN_POD_NAMESPACE",
    ]


def test_cache_keys_ignore_the_preemption_settings(tmp_path: Path) -> None:
    """What KFP's cache key reads of a task (its inputs, config_json among them, command, args and image) is
    the same whatever the retries and the queue: a cached run stays cached when they change."""

    def keyed(overrides: list[str]) -> dict:
        spec, _ = compiled(tmp_path, overrides)
        executors = json_format.MessageToDict(spec.deployment_spec)["executors"]
        tasks = json_format.MessageToDict(spec.root.dag)["tasks"]
        containers = {n: {k: v for k, v in c["container"].items() if k != "env"} for n, c in executors.items()}
        inputs = {n: t.get("inputs") for n, t in tasks.items()}
        return {
            "containers": containers,
            "inputs": inputs,
            "root": json_format.MessageToDict(spec.root.input_definitions),
        }

    plain = keyed(["kubernetes.pvc=rlhf"])
    assert plain == keyed(
        [
            "kubernetes.pvc=rlhf",
            "kubernetes.queue=q",
            "kubernetes.retries=5",
            "kubernetes.retry_backoff=5m",
            "kubernetes.retry_backoff_max=2h",
        ]
    )
    assert plain != keyed(["kubernetes.pvc=other"])  # the tasks read the PVC's mount (a TrainJob's nodes)


def test_a_local_run_compiles_without_retries(tmp_path: Path) -> None:
    """kfp.local honours retry policies with their backoff: `kubealign run` would wait minutes before
    failing a task that fails the same way each time, so the local DAG has none (the cluster's keeps them)."""
    from kubealign.pipelines.local import without_retries

    config = load_config(None, ["kubernetes.retries=3"])
    path = compile_pipeline(without_retries(config), tmp_path / "local.yaml")
    tasks = yaml.safe_load_all(path.read_text(encoding="utf-8")).__next__()["root"]["dag"]["tasks"]
    assert not any("retryPolicy" in task for task in tasks.values())
    assert config.kubernetes.retries == 3  # the caller's config is left as it was


def test_every_task_carries_the_compile_time_pins(tmp_path: Path) -> None:
    """The sections allowed to run a model's code sit in every task's container, the reward functions'
    sha256 (equal to that of the `reward_functions` parameter's default) in those that read them: not in a
    parameter a run can edit, and not where it would change the cache key of tasks the functions do not touch."""
    import hashlib

    spec, _ = compiled(tmp_path, [GRPO_DPO])
    default = spec.root.input_definitions.parameters["reward_functions"].default_value.string_value
    executors = json_format.MessageToDict(spec.deployment_spec)["executors"]
    scoring = set()
    for name, executor in executors.items():
        env = {e["name"]: e.get("value", "") for e in executor["container"]["env"]}
        assert env["KUBEALIGN_TRUST_REMOTE_CODE"] == "", name
        if "KUBEALIGN_REWARD_FUNCTIONS_SHA256" in env:
            assert env["KUBEALIGN_REWARD_FUNCTIONS_SHA256"] == hashlib.sha256(default.encode()).hexdigest()
            scoring.add(name)
    assert scoring == {"exec-grpo", "exec-evaluate-grpo", "exec-evaluate-dpo"}


def test_the_serve_task_follows_promote_only_when_asked(tmp_path: Path) -> None:
    spec, platform = compiled(tmp_path, ["serve.enabled=true"])
    tasks = spec.root.dag.tasks
    assert {a.task_output_artifact.producer_task for a in tasks["serve"].inputs.artifacts.values()} == {"promote"}
    assert not tasks["serve"].caching_options.enable_cache  # the cluster is outside KFP's view
    fields = {f.name: f.field_path for f in platform["exec-serve"].field_path_as_env}
    assert fields == {
        "KUBEALIGN_POD_NAMESPACE": "metadata.namespace",  # where the InferenceService goes
        "KUBEALIGN_RUN_ID": "metadata.labels['pipeline/runid']",  # annotated on it
    }
    assert [s.secret_name for s in platform["exec-serve"].secret_as_env][0] == "kubealign-mlflow"  # the registry
    assert "judge" not in tasks  # promote.mode direct: no canary to judge
    spec, platform = compiled(tmp_path, ["serve.enabled=true", "promote.mode=canary"])
    tasks = spec.root.dag.tasks
    judge, act = tasks["judge"], tasks["act"]
    producers = {k: a.task_output_artifact.producer_task for k, a in judge.inputs.artifacts.items()}
    assert producers == {"prompts": "data-split", "tokenizer": "sft", "reward_model": "reward", "serving": "serve"}
    assert not judge.caching_options.enable_cache  # the served models and the registry: outside KFP's view
    # act after judge, on its verdict alone; judge scores as the tracking identity, act moves as the pipeline's
    assert {k: a.task_output_artifact.producer_task for k, a in act.inputs.artifacts.items()} == {"judgement": "judge"}
    assert set(act.dependent_tasks) == {"judge"} and "act" not in judge.dependent_tasks
    assert not act.caching_options.enable_cache
    assert act.inputs.artifacts["judgement"].task_output_artifact.output_artifact_key == "judgement"
    assert [s.secret_name for s in platform["exec-judge"].secret_as_env] == ["kubealign-mlflow-tracker"]
    assert [s.secret_name for s in platform["exec-act"].secret_as_env][0] == "kubealign-mlflow"  # acts there
    spec, _ = compiled(tmp_path, ["serve.enabled=true", "promote.mode=canary", "canary.act=false"])
    assert "judge" in spec.root.dag.tasks and "act" not in spec.root.dag.tasks  # the judge only reports
    spec, _ = compiled(tmp_path, [])
    assert not {"serve", "judge", "act"} & set(spec.root.dag.tasks)


def test_a_canary_held_for_people_is_settled_after_the_pull_and_before_promote(tmp_path: Path) -> None:
    canary = ["serve.enabled=true", "promote.mode=canary", "canary.min_human_win_rate=0.5", "canary.await_people=true"]
    spec, platform = compiled(tmp_path, [*canary, "feedback.project=prefs"])
    tasks = spec.root.dag.tasks
    settle = tasks["settle"]
    assert set(settle.dependent_tasks) == {"feedback"} and not settle.caching_options.enable_cache
    given = settle.inputs.parameters["config_json"].task_output_parameter  # the round as the pull counted it
    assert (given.producer_task, given.output_parameter_key) == ("feedback", "Output")
    assert "settle" in tasks["promote"].dependent_tasks and "settle" not in tasks["data-split"].dependent_tasks
    assert [s.secret_name for s in platform["exec-settle"].secret_as_env][0] == "kubealign-mlflow"  # moves aliases
    spec, _ = compiled(tmp_path, canary)  # no project: first of all, on the run's own config
    assert set(spec.root.dag.tasks["settle"].dependent_tasks) == set()
    assert "settle" in spec.root.dag.tasks["promote"].dependent_tasks
    for off in ("canary.await_people=false", "canary.act=false", "promote.mode=direct"):
        spec, _ = compiled(tmp_path, [*canary, off])
        assert "settle" not in spec.root.dag.tasks, off


def test_serve_takes_one_route(cli, tmp_path: Path) -> None:
    done = cli(
        "compile",
        "--set",
        "serve.enabled=true",
        "--set",
        "pipeline.candidates=[{route: ppo}, {route: dpo}]",
        "-o",
        str(tmp_path / "p.yaml"),
    )
    assert done.code == 2 and "serve.enabled takes one route" in done.err
