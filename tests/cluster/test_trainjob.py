"""Multi-node PPO: the TrainJob manifest against the Kubeflow Trainer CRD, and how its status maps
onto the KFP task (driven with recorded status objects: no cluster runs here)."""

from __future__ import annotations

import pytest

from kubealign.cluster import trainjob
from kubealign.config import load_config
from kubealign.tasks.launch import torchrun_command
from tests.support.k8s_schemas import errors

TWO_BY_EIGHT = [
    "kubernetes.ppo_nodes=2",
    "kubernetes.ppo_gpus=8",
    "kubernetes.pvc=rlhf-shared",
    "kubernetes.namespace=team-a",
    "kubernetes.node_selector={gpu: h100}",
    "kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
    "kubernetes.trainjob_timeout_s=7200",
]


def two_by_eight() -> dict:
    k8s = load_config("opt-13b-8gpu", TWO_BY_EIGHT).kubernetes
    command = torchrun_command(0, ["ppo", "--config", "/mnt/kubealign/x/config.yaml"], nnodes_from_env=True)
    return trainjob.manifest("kubealign-ppo-abc", k8s, "registry/kubealign-train:0.1.0", command, {"A": "1"})


def test_two_nodes_by_eight_gpus_validates_against_the_crd() -> None:
    body = two_by_eight()
    assert errors(body) == []
    trainer = body["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8"}
    assert body["metadata"]["namespace"] == "team-a"
    env = {e["name"]: e for e in trainer["env"]}
    assert env["A"] == {"name": "A", "value": "1"}
    # credentials as Secret references, never copied as values into the TrainJob object; the nodes run the
    # reward functions: the tracking identity, no object store (issue 54), as on the ppo task's own pod
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kubealign-mlflow-tracker"
    assert "AWS_SECRET_ACCESS_KEY" not in env and "AWS_ACCESS_KEY_ID" not in env
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in trainer["env"] if "valueFrom" in e}
    assert refs == {"kubealign-mlflow-tracker"}
    assert body["spec"]["runtimeRef"] == {
        "name": "kubealign-deepspeed",
        "kind": "ClusterTrainingRuntime",
        "apiGroup": "trainer.kubeflow.org",
    }
    pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    spec = pod["template"]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in spec["volumes"]
    assert spec["nodeSelector"] == {"gpu": "h100"}
    # torchrun takes nnodes / node rank / master from the PET_* variables the Trainer sets: no --standalone
    assert "--standalone" not in trainer["command"] and trainer["command"][-4:-2] == ["kubealign.cli", "ppo"]


def test_the_nodes_get_the_object_store_only_when_asked() -> None:
    """kubernetes.object_store_user_code (an MLflow that does not proxy artifacts): the nodes' env as the ppo
    pod's (kubealign.cluster.secrets.pod_secrets)."""
    k8s = load_config("opt-13b-8gpu", [*TWO_BY_EIGHT, "kubernetes.object_store_user_code=true"]).kubernetes
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in trainjob.secret_env(k8s)}
    assert refs["AWS_SECRET_ACCESS_KEY"] == "kubealign-object-store"
    assert refs["MLFLOW_TRACKING_PASSWORD"] == "kubealign-mlflow-tracker"


def test_the_schema_check_catches_a_misspelled_field() -> None:
    body = two_by_eight()
    body["spec"]["trainer"]["numNode"] = body["spec"]["trainer"].pop("numNodes")
    assert any("numNode" in e for e in errors(body))
    body = two_by_eight()
    body["spec"]["trainer"]["numNodes"] = "2"
    assert any("numNodes" in e and "integer" in e for e in errors(body))


class FakeCustomObjects:
    """Returns one recorded TrainJob status per poll; records deletes."""

    def __init__(self, statuses: list[dict]):
        self.statuses, self.deleted = list(statuses), []

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        assert (group, version, plural) == ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return {"metadata": {"name": name}, "status": status}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.deleted.append((namespace, name))


def cond(kind: str, status: str = "True", message: str = "") -> dict:
    return {"conditions": [{"type": kind, "status": status, "message": message, "reason": kind}]}


def test_complete_after_running_succeeds() -> None:
    api = FakeCustomObjects([{}, cond("Complete", "False"), cond("Complete", message="jobset completed")])
    assert trainjob.wait(api, "j", "ns", timeout_s=None, sleep=lambda s: None) == "jobset completed"
    assert api.statuses == [cond("Complete", message="jobset completed")]  # polled through both running states


def test_failed_fails_the_task_with_the_trainers_message() -> None:
    api = FakeCustomObjects([{}, cond("Failed", message="node-1 OOMKilled")])
    with pytest.raises(trainjob.TrainJobFailed, match="ns/j failed: node-1 OOMKilled"):
        trainjob.wait(api, "j", "ns", timeout_s=None, sleep=lambda s: None)
    assert api.deleted == []  # a failed job is left for inspection


def test_timeout_deletes_the_job() -> None:
    api = FakeCustomObjects([{}])
    now = iter(range(0, 10_000, 60))
    with pytest.raises(trainjob.TrainJobFailed, match="still running after 300 s"):
        trainjob.wait(api, "j", "ns", timeout_s=300, clock=lambda: next(now), sleep=lambda s: None)
    assert api.deleted == [("ns", "j")]


def test_multi_node_needs_a_shared_volume(cli) -> None:
    result = cli("config", "show", "--set", "kubernetes.ppo_nodes=2")
    assert result.code == 2 and "kubernetes.pvc" in result.err


def test_owner_queue_and_grace_period_validate_against_the_crd() -> None:
    k8s = load_config("opt-13b-8gpu", [*TWO_BY_EIGHT, "kubernetes.queue=team-a-gpus", "kubernetes.grace_period_s=300"])
    pod_env = {"KUBEALIGN_POD_NAME": "run-x-ppo-123", "KUBEALIGN_POD_UID": "0d1e", "KUBEALIGN_POD_NAMESPACE": "team-a"}
    owners = trainjob.owner_references(pod_env, k8s.kubernetes.namespace)
    body = trainjob.manifest("kubealign-ppo-abc", k8s.kubernetes, "img", ["torchrun"], {}, owners)
    assert errors(body) == []
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "run-x-ppo-123", "uid": "0d1e", "blockOwnerDeletion": False}
    ]
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    pod = body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    # no queue, no owner: neither key appears
    plain = trainjob.manifest("j", load_config("opt-13b-8gpu", TWO_BY_EIGHT).kubernetes, "img", ["x"])
    assert "ownerReferences" not in plain["metadata"] and list(plain["metadata"]["labels"]) == [
        "app.kubernetes.io/part-of"
    ]


def test_the_owner_is_the_task_pod_only_in_the_trainjobs_namespace() -> None:
    """Kubernetes has no cross-namespace owners: its garbage collector would delete the TrainJob at once."""
    pod = {"KUBEALIGN_POD_NAME": "p", "KUBEALIGN_POD_UID": "u", "KUBEALIGN_POD_NAMESPACE": "kubeflow-user"}
    assert trainjob.owner_references(pod, "team-a") == []
    assert [o["name"] for o in trainjob.owner_references(pod, "kubeflow-user")] == ["p"]
    assert trainjob.owner_references({**pod, "KUBEALIGN_POD_UID": ""}, "kubeflow-user") == []
    assert trainjob.owner_references({}, "kubeflow-user") == []


class NotFound(Exception):
    status = 404


class Cluster:
    """A namespace of TrainJobs: create / get / delete, a deleted job lingering for `linger` gets (its pods
    terminating), each get of a live job returning the next recorded status."""

    def __init__(self, existing: dict | None = None, statuses: list[dict] | None = None, linger: int = 0):
        self.jobs = dict(existing or {})
        self.statuses, self.linger, self.log = list(statuses or [{}]), linger, []
        self.deleting: dict[str, int] = {}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        name = body["metadata"]["name"]
        assert name not in self.jobs, "409 AlreadyExists"
        self.jobs[name] = body
        self.log.append(("create", name))

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if name in self.deleting:
            self.deleting[name] -= 1
            if self.deleting[name] < 0:
                del self.deleting[name], self.jobs[name]
        if name not in self.jobs:
            raise NotFound(name)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return {"metadata": {"name": name}, "status": status}

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        if name not in self.jobs:
            raise NotFound(name)
        self.log.append(("delete", name))
        self.deleting[name] = self.linger


def test_a_retry_replaces_the_trainjob_its_predecessor_left_and_waits_until_it_is_gone() -> None:
    cluster = Cluster(existing={"j": {}}, linger=2)
    sleeps = []
    assert trainjob.replace_leftover(cluster, "j", "ns", timeout_s=100, sleep=sleeps.append, clock=lambda: 0.0)
    assert cluster.log == [("delete", "j")] and "j" not in cluster.jobs and len(sleeps) == 2
    assert not trainjob.replace_leftover(cluster, "j", "ns", timeout_s=100, sleep=sleeps.append)  # none left
    stuck = Cluster(existing={"j": {}}, linger=10**6)
    now = iter(range(0, 10**6, 30))
    with pytest.raises(trainjob.TrainJobFailed, match="still exists 90 s after its deletion"):
        trainjob.replace_leftover(stuck, "j", "ns", timeout_s=90, sleep=lambda s: None, clock=lambda: next(now))


def test_a_task_that_stops_while_waiting_deletes_its_trainjob() -> None:
    from kubealign.errors import Stopped

    body = {"metadata": {"name": "j", "namespace": "ns"}, "spec": {"trainer": {"numNodes": 2}}}
    cluster = Cluster(statuses=[{}])

    def sigterm(seconds: float) -> None:
        raise Stopped("ppo: stopped by SIGTERM", 15)

    with pytest.raises(Stopped):
        trainjob.run(cluster, None, body, timeout_s=None, sleep=sigterm)
    assert cluster.log == [("create", "j"), ("delete", "j")]
    # Complete: nothing deleted; Failed: kept for inspection (the retry replaces it)
    for statuses, raises in (([{}, cond("Complete")], False), ([cond("Failed", message="OOMKilled")], True)):
        cluster = Cluster(statuses=statuses)
        if raises:
            with pytest.raises(trainjob.TrainJobFailed, match="OOMKilled"):
                trainjob.run(cluster, None, body, timeout_s=None, sleep=lambda s: None)
        else:
            trainjob.run(cluster, None, body, timeout_s=None, sleep=lambda s: None)
        assert cluster.log == [("create", "j")]
