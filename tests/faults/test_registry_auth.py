"""The chart's registry with authentication on, for real (issue 37): who may move `champion`.

The chart is rendered with its default values (authentication on, sqlite and artifacts on the PVC) for the
release `kubealign` in `kubeflow`, and its pods' containers run here with exactly their command, args and
environment: the init container writes the basic-auth ini, the MLflow server starts as the Deployment starts
it, the identities Job creates the pipeline and reader identities. The Secrets are the chart's own generated
ones (their random passwords decoded). Only what is host-specific changes: the PVC and the emptyDir become
directories here, the server listens on 127.0.0.1 instead of 0.0.0.0, the Job reaches it there.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from kubealign.cluster.registry_auth import IDENTITIES
from kubealign.config.cluster import KubernetesConfig
from tests.cluster.test_chart import CHART
from tests.faults.test_faults_registry import CALL_LIMIT_S, KUBEALIGN, evaluation, one_line_error, promote_args
from tests.support.faults import MlflowServer, free_port
from tests.support.stores import container_env, expand, process_env

pytestmark = pytest.mark.faults

RELEASE, NAMESPACE = "kubealign", "kubeflow"
DAG_LIMIT_S = 900


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


class ChartRegistry:
    """The rendered pod (init container + server) and identities Job, run here under `root`."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        docs = render({"mlflow": {"port": self.port}})
        self.secrets = {
            (d["metadata"]["name"], key): base64.b64decode(value).decode()
            for d in docs
            if d["kind"] == "Secret" and d["metadata"]["namespace"] == NAMESPACE
            for key, value in d["data"].items()
        }
        pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        job = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
        [self.init], [self.server_container], [self.job] = pod["initContainers"], pod["containers"], job["containers"]
        self.service_host = f"{RELEASE}-mlflow.{NAMESPACE}.svc.cluster.local:{self.port}"

    def local(self, text: str) -> str:
        """A path of the pod (the PVC at /data, the auth emptyDir at /auth) as a directory here."""
        for mount in ("/data", "/auth"):
            text = text.replace(f"{mount}/", f"{self.root}{mount}/")
        return text

    def argv(self, container: dict) -> list[str]:
        """The container's command line, Kubernetes' $(VAR) expansion done, this environment's executable."""
        argv = [
            self.local(arg) for arg in expand(container["command"] + container.get("args", []), self.env(container))
        ]
        return [str(Path(sys.executable).with_name(argv[0])), *argv[1:]]

    def env(self, container: dict) -> dict[str, str]:
        return {k: self.local(v) for k, v in container_env(container, self.secrets, {}).items()}

    def start(self) -> ChartRegistry:
        (self.root / "data").mkdir(parents=True)
        (self.root / "auth").mkdir()
        env = self.env(self.init)
        done = subprocess.run(
            self.argv(self.init), env=process_env(env), capture_output=True, text=True, timeout=CALL_LIMIT_S
        )
        assert done.returncode == 0, done.stderr[-3000:]
        env = self.env(self.server_container)
        argv = self.argv(self.server_container)
        assert "--host=0.0.0.0" in argv, argv  # the pod listens on every address; here only loopback
        argv[argv.index("--host=0.0.0.0")] = "--host=127.0.0.1"
        self.server = MlflowServer(self.root, command=argv, env=process_env(env), port=self.port).start()
        return self

    def identities_job(self) -> subprocess.CompletedProcess:
        env = self.env(self.job)
        argv = [arg.replace(f"http://{self.service_host}", self.url) for arg in self.argv(self.job)]
        assert f"--tracking-uri={self.url}" in argv, argv
        return subprocess.run(argv, env=process_env(env), capture_output=True, text=True, timeout=CALL_LIMIT_S)

    def identity(self, secret: str) -> dict[str, str]:
        """The MLflow client variables of an identity, from its Secret."""
        keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
        return {key: self.secrets[(secret, key)] for key in keys}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    reg = ChartRegistry(tmp_path_factory.mktemp("auth")).start()
    yield reg
    reg.server.kill()


def kubealign(registry: ChartRegistry, identity: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    env = {**process_env({}), "MLFLOW_TRACKING_URI": registry.url, "OMP_NUM_THREADS": "1", **identity}
    return subprocess.run(
        [str(KUBEALIGN), *map(str, args)], env=env, capture_output=True, text=True, timeout=CALL_LIMIT_S
    )


def status(url: str, host: str | None = None, auth: tuple[str, str] | None = None) -> int:
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/registered-models/search?max_results=1")
    if host:
        request.add_header("Host", host)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def admin_aliases(registry: ChartRegistry, name: str) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    admin = registry.identity(f"{RELEASE}-mlflow-admin")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in admin.items():
            mp.setenv(key, value)
        return {a: str(v) for a, v in MlflowClient(registry.url).get_registered_model(name).aliases.items()}


def test_the_pipeline_identity_is_the_one_the_pipeline_reads() -> None:
    """The chart's pipeline Secret is named what kubernetes.mlflow_secret names by default, in the pipeline's
    namespace, with the keys a task pod's environment gets (cluster.secrets)."""
    from kubealign.cluster.secrets import MLFLOW_SECRET_KEYS

    docs = render({"rbac": {"namespace": "team-a"}})
    default = KubernetesConfig().mlflow_secret
    copies = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == default]
    assert sorted(d["metadata"]["namespace"] for d in copies) == ["kubeflow", "team-a"]
    assert copies[0]["data"] == copies[1]["data"]  # one identity, one password
    assert set(copies[0]["data"]) == set(MLFLOW_SECRET_KEYS)


def test_the_identities_job_creates_both_and_a_rerun_sets_their_passwords(registry: ChartRegistry) -> None:
    variables = {entry["name"] for entry in registry.job["env"]}
    assert {var for _, *pair in IDENTITIES for var in pair} <= variables  # what the Job sets is what it reads
    first = registry.identities_job()
    assert first.returncode == 0, first.stderr[-3000:]
    assert "pipeline identity 'kubealign-pipeline' created" in first.stdout
    assert "tracker identity 'kubealign-tracker' created" in first.stdout
    assert "reader identity 'reader' created" in first.stdout
    grants = "kubealign-pipeline MANAGE, kubealign-tracker EDIT, reader READ"
    assert f"experiment 'kubealign' created: {grants}" in first.stdout
    again = registry.identities_job()  # every helm upgrade runs it again
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("exists: password set from its Secret") == 3
    assert f"experiment 'kubealign' exists: {grants}" in again.stdout


def test_only_the_pipeline_identity_moves_champion(registry: ChartRegistry, tmp_path: Path) -> None:
    if status(registry.url, auth=tuple(registry.identity(f"{RELEASE}-mlflow").values())) == 401:
        assert registry.identities_job().returncode == 0  # run alone: the Job has not run yet
    name, good = "auth-promote", evaluation(tmp_path, "good", win=0.7, gain=0.3, reward=1.0)
    pipeline = registry.identity(f"{RELEASE}-mlflow")
    reader = registry.identity(f"{RELEASE}-mlflow-reader")

    nobody = kubealign(registry, {}, *promote_args(name, good, tmp_path / "p0"))
    line = one_line_error(nobody)
    assert "401" in line and "MLFLOW_TRACKING_USERNAME" in line, line
    wrong = kubealign(
        registry,
        {**reader, "MLFLOW_TRACKING_PASSWORD": "not-it"},
        "rollback",
        "--set",
        f"promote.registered_model={name}",
    )
    assert "401" in one_line_error(wrong)

    for step, evaluated in enumerate([good, evaluation(tmp_path, "better", win=0.8, gain=0.4, reward=1.5)], 1):
        done = kubealign(registry, pipeline, *promote_args(name, evaluated, tmp_path / f"p{step}"))
        assert done.returncode == 0, done.stderr[-3000:]
    moved = {"champion": "2", "challenger": "2", "previous-champion": "1"}
    assert admin_aliases(registry, name) == moved

    # the reader reads everything and moves nothing: its promote of a better model and its rollback are
    # refused, each in one line
    best = evaluation(tmp_path, "best", win=0.9, gain=0.5, reward=2.0)
    refused = kubealign(registry, reader, *promote_args(name, best, tmp_path / "p3"))
    line = one_line_error(refused)
    assert "403" in line and "may not change" in line, line
    back = kubealign(registry, reader, "rollback", "--set", f"promote.registered_model={name}")
    assert "403" in one_line_error(back)
    assert admin_aliases(registry, name) == moved
    assert not (tmp_path / "p3" / "result.json").exists()


def test_the_tracker_logs_runs_and_moves_nothing(registry: ChartRegistry, tmp_path: Path) -> None:
    """Issue 54: the identity of the pods that run reward functions (kubernetes.tracking_secret) starts a stage's
    run in the pipeline's experiment as those pods do (stage_run: params, the config as an artifact through the
    server's artifact proxy, a metric), and is refused (403) registering a version or moving `champion`, which
    the pipeline identity then does on the same server."""
    from mlflow.tracking import MlflowClient

    from kubealign.config import load_config
    from kubealign.tracking.runs import stage_run

    tracker = registry.identity(f"{RELEASE}-mlflow-tracker")
    if status(registry.url, auth=tuple(tracker.values())) == 401:
        assert registry.identities_job().returncode == 0  # run alone: the Job has not run yet
    config = load_config(None, [])  # the tiny preset's experiment: one of the chart's mlflow.auth.experiments
    name = "kubealign-actor"  # the chart's registeredModels: the Job made it the pipeline's
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
        mp.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        for key, value in {"MLFLOW_TRACKING_URI": registry.url, **tracker}.items():
            mp.setenv(key, value)
        with stage_run("evaluate", config, tmp_path) as run:
            run.log_metrics({"win_rate": 0.75})
        client = MlflowClient(registry.url)
        logged = client.get_run(run.run_id)
        assert logged.data.metrics["win_rate"] == 0.75 and logged.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(run.run_id, "config")] == ["config/resolved.yaml"]
        source = f"runs:/{run.run_id}/config"
        with pytest.raises(Exception, match="PERMISSION_DENIED|403"):
            client.create_model_version(name, source, run_id=run.run_id)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in registry.identity(f"{RELEASE}-mlflow").items():
            mp.setenv(key, value)
        version = MlflowClient(registry.url).create_model_version(name, source, run_id=run.run_id).version
    with pytest.MonkeyPatch.context() as mp:
        for key, value in tracker.items():
            mp.setenv(key, value)
        for move in ("set_registered_model_alias", "delete_registered_model_alias"):
            with pytest.raises(Exception, match="PERMISSION_DENIED|403"):
                args = (name, "champion", version) if move.startswith("set") else (name, "champion")
                getattr(MlflowClient(registry.url), move)(*args)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in registry.identity(f"{RELEASE}-mlflow").items():
            mp.setenv(key, value)
        MlflowClient(registry.url).set_registered_model_alias(name, "tracker-test", version)  # the pipeline may
    assert admin_aliases(registry, name).get("tracker-test") == str(version)
    with pytest.MonkeyPatch.context() as mp:  # the EDIT on the experiment is the tracker's, not everyone's
        for key, value in registry.identity(f"{RELEASE}-mlflow-reader").items():
            mp.setenv(key, value)
        experiment = MlflowClient(registry.url).get_experiment_by_name(config.tracking.experiment).experiment_id
        with pytest.raises(Exception, match="PERMISSION_DENIED|403"):
            MlflowClient(registry.url).create_run(experiment)


def test_the_readers_lease_squat_is_one_line_at_once(registry: ChartRegistry, tmp_path: Path) -> None:
    """The reader may create registered models (MLflow lets any identity), so it can create the promotion lease.
    A far expiry used to make every promote wait 330 s and fail, a near one a 403 on the delete that was
    swallowed (the same wait): now each is one line naming the lease and who can clear it, before any wait."""
    import time

    from mlflow.tracking import MlflowClient

    if status(registry.url, auth=tuple(registry.identity(f"{RELEASE}-mlflow").values())) == 401:
        assert registry.identities_job().returncode == 0
    name, good = "auth-lease", evaluation(tmp_path, "good", win=0.7, gain=0.3, reward=1.0)
    pipeline, reader = registry.identity(f"{RELEASE}-mlflow"), registry.identity(f"{RELEASE}-mlflow-reader")
    lock = f"{name}.promotion-lease"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reader.items():
            mp.setenv(key, value)
        client = MlflowClient(registry.url)
        client.create_registered_model(lock, tags={"owner": "squat:1:x", "expires": str(time.time() + 10**6)})
    started = time.monotonic()
    line = one_line_error(kubealign(registry, pipeline, *promote_args(name, good, tmp_path / "p1")))
    assert f"its lease {lock} was not written by a kubealign promote" in line, line
    assert time.monotonic() - started < 60
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reader.items():
            mp.setenv(key, value)
        client.set_registered_model_tag(lock, "expires", str(time.time() - 5))  # expired: a dead holder's
    line = one_line_error(kubealign(registry, pipeline, *promote_args(name, good, tmp_path / "p2")))
    assert f"the expired lease {lock} (owner 'squat:1:x') may not be deleted by this identity (403)" in line, line
    assert not (tmp_path / "p2" / "result.json").exists()


def test_the_pipelines_model_is_the_pipelines_even_if_the_reader_made_it_first(
    registry: ChartRegistry, tmp_path: Path
) -> None:
    """On a fresh registry the reader created the pipeline's registered model (MLflow gives its creator MANAGE)
    and could have set `champion` the pipeline cannot move. The identities Job, given the model's name (the
    chart's mlflow.auth.registeredModels), makes it the pipeline's and the reader's to read only."""
    from mlflow.tracking import MlflowClient

    name = "kubealign-actor"  # the chart's default, in the Job's rendered args
    assert f"--registered-model={name}" in registry.job["args"]
    reader = registry.identity(f"{RELEASE}-mlflow-reader")
    if status(registry.url, auth=tuple(reader.values())) == 401:
        assert registry.identities_job().returncode == 0  # the reader exists (here its own run may claim it first)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reader.items():
            mp.setenv(key, value)
        with contextlib.suppress(Exception):  # already claimed by an earlier run of the Job in this module
            MlflowClient(registry.url).create_registered_model(name)
    done = registry.identities_job()
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"registered model '{name}' exists: kubealign-pipeline MANAGE, kubealign-tracker READ, reader READ"
        in done.stdout
    )
    good = evaluation(tmp_path, "good", win=0.7, gain=0.3, reward=1.0)
    promoted = kubealign(registry, registry.identity(f"{RELEASE}-mlflow"), *promote_args(name, good, tmp_path / "p1"))
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in reader.items():
            mp.setenv(key, value)
        with pytest.raises(Exception, match="PERMISSION_DENIED|403"):
            MlflowClient(registry.url).set_registered_model_alias(name, "champion", "1")


def test_host_headers_other_than_the_services_are_refused(registry: ChartRegistry) -> None:
    """--allowed-hosts (DNS rebinding): the Service's names pass to authentication, a foreign name is 403."""
    assert status(registry.url, host=registry.service_host) == 401  # let through, then asked who it is
    assert status(registry.url, host=f"{RELEASE}-mlflow:{registry.port}") == 401
    assert status(registry.url, host="attacker.example:80") == 403
    assert status(registry.url) == 401


# the shortened DAG: ~80 s alone on 2 cores
def test_the_shortened_dag_runs_as_the_pipeline_identity(registry: ChartRegistry, tmp_path: Path) -> None:
    from tests.pipelines.test_kfp_local import STAGES, overrides

    if status(registry.url, auth=tuple(registry.identity(f"{RELEASE}-mlflow").values())) == 401:
        assert registry.identities_job().returncode == 0
    name, out = "auth-dag", tmp_path / "run"
    env = {**process_env({}), "MLFLOW_TRACKING_URI": registry.url, **registry.identity(f"{RELEASE}-mlflow")}
    # fewer steps than the other shortened DAGs: every request to this server pays its scrypt password check
    fewer = ["--set", "sft.num_train_epochs=1", "--set", "ppo.num_iterations=1", "--set", "evaluate.max_prompts=4"]
    command = [
        sys.executable,
        "-m",
        "kubealign.cli",
        "run",
        *overrides(),
        *fewer,
        "--set",
        f"promote.registered_model={name}",
        "--output",
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DAG_LIMIT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    index = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert index["succeeded"] and list(index["stages"]) == STAGES
    assert admin_aliases(registry, name) == {"champion": "1", "challenger": "1"}


def test_the_ini_reads_back_the_uri_with_its_escapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configparser interpolates `%`: a URI-escaped password (p%40ss = p@ss) must read back unchanged."""
    import configparser

    from kubealign.cluster.registry_auth import write_config

    uri = "postgresql://mlflow:p%40ss%25w@db:5432/mlflow"
    write_config(tmp_path / "auth" / "basic_auth.ini", {"MLFLOW_AUTH_DATABASE_URI": uri})
    parser = configparser.ConfigParser()
    parser.read(tmp_path / "auth" / "basic_auth.ini")
    assert parser["mlflow"]["database_uri"] == uri
    assert parser["mlflow"]["default_permission"] == "READ"
    assert [p.name for p in (tmp_path / "auth").iterdir()] == ["basic_auth.ini"]  # no tmp file left
    # MLflow's own reader of the file turns its credential cache on (off by default: 0)
    from mlflow.server.auth.config import read_auth_config

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "auth" / "basic_auth.ini"))
    assert read_auth_config().auth_cache_ttl_seconds == 60


def test_missing_settings_are_one_line_each(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_AUTH_DATABASE_URI", raising=False)
    done = cli("registry", "auth-config", "--output", str(tmp_path / "a.ini"))
    assert done.code == 2 and "MLFLOW_AUTH_DATABASE_URI is not set" in done.err
    assert not (tmp_path / "a.ini").exists()
    monkeypatch.setenv("KUBEALIGN_PIPELINE_USERNAME", "pipe")
    monkeypatch.delenv("KUBEALIGN_PIPELINE_PASSWORD", raising=False)
    done = cli("registry", "identities", "--tracking-uri", "http://127.0.0.1:1", "--wait", "0")
    assert done.code == 2 and "KUBEALIGN_PIPELINE_PASSWORD is not set" in done.err
    monkeypatch.setenv("KUBEALIGN_PIPELINE_PASSWORD", "pw")
    done = cli("registry", "identities", "--tracking-uri", f"http://127.0.0.1:{free_port()}", "--wait", "0")
    assert done.code == 2 and "is not up after 0 s" in done.err
