"""charts/kubealign rendered offline by the real Helm engine (helm-python-sdk), for the default values and
several value sets; every manifest validated with kubernetes-validate --strict, the Kubeflow Trainer
resources against ../shared/k8s-schemas; helm lint; the values schema; the hardened pod settings."""

from __future__ import annotations

import base64
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.support.k8s_schemas import errors as trainer_errors

pytestmark = pytest.mark.chart

CHART = Path(__file__).resolve().parents[2] / "charts" / "kubealign"
KUBE_VERSION = "1.33.0"
VALUE_SETS = {
    "default": {},
    "postgres-s3-networkpolicy-upload": {
        "mlflow": {
            "replicas": 2,
            "backendStore": {"type": "postgresql", "existingSecret": "mlflow-db"},
            "artifactStore": {
                "type": "s3",
                "s3Uri": "s3://mlflow",
                "s3EndpointUrl": "http://minio:9000",
                "existingSecret": "minio",
            },
        },
        "networkPolicy": {"enabled": True, "allowedNamespaces": ["kubeflow", "team-a"]},
        "uploadJob": {"enabled": True},
        "image": {"registry": "registry.internal/ml", "tag": "0.1.0-rc1", "pullSecrets": ["regcred"]},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    },
    "postgres-pvc-artifacts": {
        "mlflow": {"backendStore": {"type": "postgresql", "existingSecret": "mlflow-db", "secretKey": "url"}},
    },
    "label-studio-beside": {"labelStudio": {"enabled": True}, "rbac": {"namespace": "team-a"}},
    "external-mlflow-no-runtime": {
        "mlflow": {"enabled": False},
        "pipelineDefaults": {"mlflowTrackingUri": "https://mlflow.example.com"},
        "trainingRuntime": {"create": False},
        "rbac": {"namespace": "team-a"},
    },
}


def render(values: dict, name: str = "ka") -> list[dict]:
    chart = helm.Chart.load(CHART)
    out = chart.render(values, name=name, namespace="kubeflow", is_install=True)
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_validates_strictly(name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("trainer.kubeflow.org/"):
            assert trainer_errors(doc) == [], doc["kind"]
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_value_sets_change_what_is_rendered() -> None:
    kinds = {name: sorted(d["kind"] for d in render(values)) for name, values in VALUE_SETS.items()}
    assert kinds["default"] == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Service",
            "PersistentVolumeClaim",
            "Role",
            "RoleBinding",
            "ClusterTrainingRuntime",
            "NetworkPolicy",
            "Secret",
            "Secret",
            "Secret",
            "Secret",
            "Job",
        ]
    )
    assert "NetworkPolicy" in kinds["postgres-s3-networkpolicy-upload"]
    assert kinds["postgres-s3-networkpolicy-upload"].count("Job") == 2  # the identities and the upload
    assert "PersistentVolumeClaim" not in kinds["postgres-s3-networkpolicy-upload"]  # nothing on a PVC
    assert "Deployment" not in kinds["external-mlflow-no-runtime"]
    config = next(d for d in render(VALUE_SETS["external-mlflow-no-runtime"]) if d["kind"] == "ConfigMap")
    assert config["data"]["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com"
    role = next(d for d in render(VALUE_SETS["external-mlflow-no-runtime"]) if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == "team-a"
    assert {"create", "watch", "delete"} <= set(role["rules"][0]["verbs"])


def test_mlflow_server_settings() -> None:
    deploy = next(d for d in render({}) if d["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kubealign/kubealign-cpu:0.1.0"  # appVersion = kubealign.__version__
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "--artifacts-destination=/data/artifacts" in container["args"]
    assert deploy["spec"]["strategy"]["type"] == "Recreate"  # sqlite: one writer
    s3 = next(d for d in render(VALUE_SETS["postgres-s3-networkpolicy-upload"]) if d["kind"] == "Deployment")
    env = {e["name"]: e for e in s3["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "uri"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "minio"


@pytest.mark.parametrize("name", ["postgres-s3-networkpolicy-upload", "postgres-pvc-artifacts"])
def test_postgresql_schema_is_migrated_before_the_server_starts(name: str) -> None:
    """An init container runs `mlflow db upgrade` on the server's own URI, from the server's image."""
    deploy = next(d for d in render(VALUE_SETS[name]) if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    server = pod["containers"][0]
    upgrade, auth = pod["initContainers"]  # the migration first: the auth app's tables may share its database
    assert upgrade["name"] == "mlflow-db-upgrade" and auth["name"] == "mlflow-auth-config"
    assert upgrade["command"] + upgrade["args"] == ["mlflow", "db", "upgrade", "$(MLFLOW_BACKEND_STORE_URI)"]
    assert upgrade["image"] == server["image"]
    # Kubernetes expands $(VAR) from the container's own env: the init container must define it, from
    # the very Secret key the server reads
    [uri] = [e for e in upgrade["env"] if e["name"] == "MLFLOW_BACKEND_STORE_URI"]
    assert uri in server["env"]
    secret = VALUE_SETS[name]["mlflow"]["backendStore"]
    assert uri["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": secret.get("secretKey", "uri")}
    assert "--backend-store-uri=$(MLFLOW_BACKEND_STORE_URI)" in server["args"]
    assert "strategy" not in deploy["spec"]  # rolling updates: PostgreSQL takes many writers


def test_sqlite_needs_no_migration_container() -> None:
    deploy = next(d for d in render({}) if d["kind"] == "Deployment")
    names = [c["name"] for c in deploy["spec"]["template"]["spec"]["initContainers"]]
    assert names == ["mlflow-auth-config"]  # the server creates its sqlite schema
    unauthenticated = next(d for d in render({"mlflow": {"auth": {"enabled": False}}}) if d["kind"] == "Deployment")
    assert "initContainers" not in unauthenticated["spec"]["template"]["spec"]


def test_pods_are_hardened() -> None:
    docs = render(VALUE_SETS["postgres-s3-networkpolicy-upload"]) + render({})
    pods = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            pods.append(doc["spec"]["template"]["spec"])
        elif doc["kind"] == "ClusterTrainingRuntime":
            pods.append(doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
    assert len(pods) >= 4
    assert any(pod.get("initContainers") for pod in pods)  # the PostgreSQL schema migration is checked too
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])  # writable scratch


def test_training_runtime_has_shm_as_memory() -> None:
    runtime = next(
        d
        for d in render({"trainingRuntime": {"shmSize": "128Gi", "terminationGracePeriodSeconds": 240}})
        if d["kind"] == "ClusterTrainingRuntime"
    )
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}} in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == 240  # SIGTERM -> the last checkpoint -> exit
    assert pod["automountServiceAccountToken"] is False  # the nodes never call the API
    assert runtime["metadata"]["name"] == "kubealign-deepspeed"  # = kubernetes.trainjob_runtime's default
    # a lost node restarts every node (JobSet), which resume from the PVC (issue 81); 0 turns it off
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 2}
    off = next(d for d in render({"trainingRuntime": {"maxRestarts": 0}}) if d["kind"] == "ClusterTrainingRuntime")
    assert "failurePolicy" not in off["spec"]["template"]["spec"]


def test_helm_lint_is_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"mlflow": {"replicaz": 2}}, "replicaz"),
        ({"mlflow": {"port": "5000"}}, "/mlflow/port"),
        ({"mlflow": {"backendStore": {"type": "mysql"}}}, "/mlflow/backendStore/type"),
        ({"mlflow": {"backendStore": {"type": "postgresql"}}}, "/mlflow/backendStore/existingSecret"),
        (
            {"securityContext": {"runAsNonRoot": False, "allowPrivilegeEscalation": False}},
            "/securityContext/runAsNonRoot",
        ),
        ({"uploadJob": {"kfpHost": "ml-pipeline:8888"}}, "/uploadJob/kfpHost"),
        ({"extra": 1}, "extra"),
        ({"mlflow": {"allowedHosts": "*"}}, "/mlflow/allowedHosts"),  # the string of before: now a list
        ({"mlflow": {"auth": {"enable": False}}}, "enable"),
    ],
)
def test_bad_values_are_rejected_naming_the_key(values: dict, named: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=named):
        helm.Chart.load(CHART).render(values, name="ka", namespace="kubeflow")


def test_every_value_is_documented() -> None:
    """Every key has a `# --` comment on the line above, except the fields of plain Kubernetes objects
    (resources, security contexts), which their block's comment covers."""
    kubernetes_objects = {"resources", "podSecurityContext", "securityContext"}
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    parents: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or ":" not in stripped:
            continue
        indent, key = len(line) - len(line.lstrip()), stripped.split(":")[0]
        parents = [(d, k) for d, k in parents if d < indent]
        if not any(k in kubernetes_objects for _, k in parents):
            assert lines[i - 1].strip().startswith("# --"), f"values.yaml:{i + 1}: {key} has no '# --' comment"
        parents.append((indent, key))


def _server(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_the_registry_signs_everyone_in_by_default() -> None:
    """Authentication on, its ini written where the server reads it, the admin from the chart's Secret."""
    docs = render({})
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    server, [init] = pod["containers"][0], pod["initContainers"]
    assert "--app-name=basic-auth" in server["args"]
    env = {e["name"]: e for e in server["env"]}
    ini = env["MLFLOW_AUTH_CONFIG_PATH"]["value"]
    assert init["command"] + init["args"] == ["kubealign", "registry", "auth-config", f"--output={ini}"]
    mount = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]}["auth"] == mount["auth"] == str(Path(ini).parent)
    assert {"name": "auth", "emptyDir": {}} in pod["volumes"]
    [uri] = [e for e in init["env"] if e["name"] == "MLFLOW_AUTH_DATABASE_URI"]
    assert uri["value"] == "sqlite:////data/basic_auth.db"  # on the PVC, beside mlflow.db
    for var, key in (
        ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"),
        ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_TRACKING_PASSWORD"),
        ("MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_FLASK_SERVER_SECRET_KEY"),
    ):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "ka-kubealign-mlflow-admin", "key": key}
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {
        "ka-kubealign-mlflow-admin",
        "ka-kubealign-mlflow",
        "ka-kubealign-mlflow-tracker",
        "ka-kubealign-mlflow-reader",
    }
    for secret in secrets.values():
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert len(base64.b64decode(secret["data"]["MLFLOW_TRACKING_PASSWORD"])) == 32
    passwords = {s["data"]["MLFLOW_TRACKING_PASSWORD"] for s in secrets.values()}
    assert len(passwords) == 4  # four identities, four passwords
    off = render({"mlflow": {"auth": {"enabled": False}}})
    assert "--app-name=basic-auth" not in _server(off)["args"]
    assert not [d for d in off if d["kind"] in ("Secret", "Job")]


def test_the_tracker_identity_is_what_the_user_code_pods_read() -> None:
    """Issue 54: the tracker's Secret is named what kubernetes.tracking_secret names by default (release
    `kubealign`), in the release's and the pipeline's namespaces, with the MLflow keys those pods get; the
    identities Job creates it and grants it EDIT on the pipeline's experiments, nothing on its models."""
    from kubealign.cluster.secrets import MLFLOW_SECRET_KEYS
    from kubealign.config.cluster import KubernetesConfig

    docs = render({"rbac": {"namespace": "team-a"}}, name="kubealign")
    default = KubernetesConfig().tracking_secret
    copies = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == default]
    assert sorted(d["metadata"]["namespace"] for d in copies) == ["kubeflow", "team-a"]
    assert copies[0]["data"] == copies[1]["data"] and set(copies[0]["data"]) == set(MLFLOW_SECRET_KEYS)
    assert base64.b64decode(copies[0]["data"]["MLFLOW_TRACKING_USERNAME"]) == b"kubealign-tracker"
    pipeline = next(
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == KubernetesConfig().mlflow_secret
    )
    assert pipeline["data"]["MLFLOW_TRACKING_PASSWORD"] != copies[0]["data"]["MLFLOW_TRACKING_PASSWORD"]
    job = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in job["env"] if "valueFrom" in e}
    assert refs["KUBEALIGN_TRACKER_PASSWORD"] == {"name": default, "key": "MLFLOW_TRACKING_PASSWORD"}
    assert "--experiment=kubealign" in job["args"] and "--registered-model=kubealign-actor" in job["args"]
    # every preset's experiment (and the config's default) is the tracker's to log runs in out of the box
    from kubealign.config import load_config
    from kubealign.config.schema import TrackingConfig

    presets = {load_config(p.stem, []).tracking.experiment for p in (CHART.parents[1] / "configs").glob("*.yaml")}
    presets.add(TrackingConfig().experiment)
    assert {f"--experiment={name}" for name in presets} <= set(job["args"])
    others = render({"mlflow": {"auth": {"experiments": ["team-a", "team b"]}}})
    job = next(d for d in others if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in job["args"] if a.startswith("--experiment")] == ["--experiment=team-a", "--experiment=team b"]


def test_the_users_own_secrets_replace_the_generated_ones() -> None:
    values = {
        "mlflow": {
            "auth": {"adminSecret": "adm", "pipelineSecret": "pipe", "trackerSecret": "trk", "readerSecret": "ro"},
            "backendStore": {"type": "postgresql", "existingSecret": "mlflow-db"},
        }
    }
    docs = render(values)
    assert not [d for d in docs if d["kind"] == "Secret"]
    env = {e["name"]: e for e in _server(docs)["env"]}
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "adm"
    job = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in job["env"] if "valueFrom" in e}
    assert refs == {
        "MLFLOW_TRACKING_USERNAME": "adm",
        "MLFLOW_TRACKING_PASSWORD": "adm",
        "KUBEALIGN_PIPELINE_USERNAME": "pipe",
        "KUBEALIGN_PIPELINE_PASSWORD": "pipe",
        "KUBEALIGN_TRACKER_USERNAME": "trk",
        "KUBEALIGN_TRACKER_PASSWORD": "trk",
        "KUBEALIGN_READER_USERNAME": "ro",
        "KUBEALIGN_READER_PASSWORD": "ro",
    }
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if c["name"] == "mlflow-auth-config")
    [uri] = [e for e in init["env"] if e["name"] == "MLFLOW_AUTH_DATABASE_URI"]
    assert uri["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "uri"}  # the tracking store's database
    values["mlflow"]["auth"]["databaseSecretKey"] = "auth-uri"
    pod = next(d for d in render(values) if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    init = next(c for c in pod["initContainers"] if c["name"] == "mlflow-auth-config")
    [uri] = [e for e in init["env"] if e["name"] == "MLFLOW_AUTH_DATABASE_URI"]
    assert uri["valueFrom"]["secretKeyRef"] == {"name": "mlflow-db", "key": "auth-uri"}


def _allowed_hosts(values: dict) -> list[str]:
    arg = next(a for a in _server(render(values))["args"] if a.startswith("--allowed-hosts="))
    return arg.removeprefix("--allowed-hosts=").split(",")


def test_only_the_services_own_names_are_allowed_hosts() -> None:
    svc = "ka-kubealign-mlflow"
    names = [svc, f"{svc}.kubeflow", f"{svc}.kubeflow.svc", f"{svc}.kubeflow.svc.cluster.local"]
    expected = [h for name in names for h in (name, f"{name}:5000")] + ["localhost:*", "127.0.0.1:*"]
    assert _allowed_hosts({}) == expected
    assert _allowed_hosts({"mlflow": {"allowedHosts": ["mlflow.example.com"]}}) == [*expected, "mlflow.example.com"]
    assert _allowed_hosts({"mlflow": {"allowedHosts": ["*", "x"]}}) == ["*"]
    assert f"{svc}.kubeflow.svc.cluster.local:5001" in _allowed_hosts({"mlflow": {"port": 5001}})


def test_the_network_policy_is_on_and_names_the_pipelines_namespace() -> None:
    def sources(values: dict) -> list:
        [policy] = [d for d in render(values) if d["kind"] == "NetworkPolicy"]
        return policy["spec"]["ingress"][0]["from"]

    by_name = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}
    assert sources({}) == [{"podSelector": {}}, by_name]  # kubeflow is the release's own namespace
    team = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}}
    assert sources({"rbac": {"namespace": "team-a"}}) == [{"podSelector": {}}, team, by_name]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_label_studio_beside_gets_its_token_secret_and_network_policy_in_the_pipelines_namespace() -> None:
    """docs/feedback.md "On the cluster": the token the feedback task sends (feedback.token_secret, key
    LABEL_STUDIO_API_KEY), kept across upgrades; Label Studio's app pods reachable from the pipeline's namespace
    and the ingress gateway only; the library's defaults name what the two charts make."""
    from kubealign.config.feedback import FeedbackConfig
    from kubealign.feedback.client import TOKEN_ENV

    docs = render(VALUE_SETS["label-studio-beside"])
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "label-studio-token"]
    assert secret["metadata"]["namespace"] == "team-a" and set(secret["data"]) == {TOKEN_ENV}
    token = base64.b64decode(secret["data"][TOKEN_ENV]).decode()
    assert len(token) == 40 and token.isalnum() and token == token.lower()
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert FeedbackConfig().token_secret == secret["metadata"]["name"]
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-label-studio")]
    assert policy["metadata"]["namespace"] == "team-a"
    labels = {"app.kubernetes.io/name": "ls-app", "app.kubernetes.io/instance": "label-studio"}
    assert policy["spec"]["podSelector"]["matchLabels"] == labels
    by_name = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {}}, by_name], "ports": [{"protocol": "TCP", "port": 8085}]}
    ]
    # Label Studio's chart, release label-studio: Service label-studio-ls-app on port 80 (targetPort 8085)
    assert FeedbackConfig().url == "http://label-studio-ls-app:80"
    quiet = render({"labelStudio": {"enabled": True}, "networkPolicy": {"enabled": False}})
    assert not [d for d in quiet if d["kind"] == "NetworkPolicy"]
    assert [d for d in quiet if d["metadata"]["name"] == "label-studio-token"]
    assert not [d for d in render({}) if "label-studio" in d["metadata"]["name"]]  # off by default


def test_the_pipeline_may_manage_inference_services_only_as_the_serve_task_needs() -> None:
    def rules(values: dict) -> list[dict]:
        return next(d for d in render(values) if d["kind"] == "Role")["rules"]

    from kubealign.serving.manifest import GROUP, PLURAL

    [rule] = [r for r in rules({}) if r["apiGroups"] == [GROUP]]
    assert rule == {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "create", "patch"]}  # no delete
    assert not [r for r in rules({"rbac": {"inferenceServices": False}}) if r["apiGroups"] == [GROUP]]


def test_the_chart_renders_an_inference_service_only_when_asked_and_as_the_serve_task_would() -> None:
    """serving.enabled: the same predictor kubealign.serving.manifest writes for the same settings (a CPU vllm
    predictor: kubealign's serve image, fp32, the KV cache), in the pipeline's namespace, valid for KServe."""
    from kubealign.config.serve import ServeConfig
    from kubealign.serving.location import Served
    from kubealign.serving.manifest import inference_service

    assert not [d for d in render({}) if d["kind"] == "InferenceService"]
    uri = "s3://models/run-1/model/artifacts/abc"
    values = {
        "enabled": True,
        "storageUri": uri,
        "runtime": "vllm",
        "gpus": 0,
        "cpu": "2",
        "memory": "8Gi",
        "kvCacheGib": 3,
        "registeredModel": "rlhf-actor",
        "modelVersion": "7",
        "serviceAccount": "s3-reader",
    }
    [isvc] = [
        d for d in render({"serving": values, "rbac": {"namespace": "team-a"}}) if d["kind"] == "InferenceService"
    ]
    assert trainer_errors(isvc) == []  # KServe v0.20.0's CRD, unknown fields refused
    assert isvc["metadata"]["namespace"] == "team-a" and isvc["metadata"]["name"] == "kubealign-served"
    labels = isvc["metadata"]["labels"]
    assert labels["networking.kserve.io/visibility"] == "cluster-local"
    assert labels["kubealign.io/registered-model"] == "rlhf-actor" and labels["kubealign.io/model-version"] == "7"
    cfg = ServeConfig(
        runtime="vllm",
        gpus=0,
        cpu="2",
        memory="8Gi",
        kv_cache_gib=3,
        service_account="s3-reader",
        name="kubealign-served",
    )
    expected = inference_service(Served("rlhf-actor", "7", "champion", "r", "m"), uri, cfg, "team-a")
    assert isvc["spec"] == expected["spec"]
    assert isvc["spec"]["predictor"]["model"]["image"] == "ghcr.io/kubealign/kubealign-serve:0.1.0"
    # on GPUs, huggingface: the runtime's own image, the GPUs in the resources, public when asked, extra args
    gpu = {"enabled": True, "storageUri": uri, "gpus": 2, "args": ["--max-model-len=2048"], "public": True}
    [isvc] = [d for d in render({"serving": gpu}) if d["kind"] == "InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    assert trainer_errors(isvc) == [] and "image" not in model and "env" not in model
    assert model["runtime"] == "kserve-huggingfaceserver" and model["args"] == ["--max-model-len=2048"]
    assert model["resources"]["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "2"}
    assert "networking.kserve.io/visibility" not in isvc["metadata"]["labels"]
    assert isvc["metadata"]["namespace"] == "kubeflow"  # the release's, without rbac.namespace


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_charts_runtime_table_agrees_with_the_librarys(gpus: int) -> None:
    """Every row of kubealign/serving/runtimes.py renders in the chart as inference_service writes it."""
    from kubealign.config.serve import ServeConfig
    from kubealign.serving.location import Served
    from kubealign.serving.manifest import inference_service
    from kubealign.serving.runtimes import RUNTIMES

    uri = "s3://models/run-1/model/artifacts/abc"
    for name in RUNTIMES:
        values = {
            "enabled": True,
            "storageUri": uri,
            "runtime": name,
            "gpus": gpus,
            "registeredModel": "m",
            "modelVersion": "2",
        }
        [isvc] = [d for d in render({"serving": values}) if d["kind"] == "InferenceService"]
        cfg = ServeConfig(runtime=name, gpus=gpus, name="kubealign-served")
        expected = inference_service(Served("m", "2", "champion", "r", "x"), uri, cfg, "kubeflow")
        assert isvc["spec"] == expected["spec"], name


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"serving": {"enabled": True}}, "serving.storageUri"),
        ({"serving": {"enabled": True, "storageUri": "mlflow-artifacts:/x"}}, "/serving/storageUri"),
        ({"serving": {"runtime": "triton"}}, "/serving/runtime"),
        ({"serving": {"args": ["max-model-len=5"]}}, "/serving/args"),
    ],
)
def test_bad_serving_values_are_refused_naming_them(values: dict, named: str) -> None:
    with pytest.raises(Exception, match=named):
        helm.Chart.load(CHART).render(values, name="ka", namespace="kubeflow")
