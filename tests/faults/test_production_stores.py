"""The chart's production MLflow for real (issue 26): a PostgreSQL backend store and S3 artifacts.

A throwaway PostgreSQL cluster (Debian's `postgresql`, initdb/pg_ctl on a 127.0.0.1 port) and moto's S3
server on 127.0.0.1 (tests/support/stores.py); the chart is rendered with its production values and the MLflow
server runs with exactly the command, args and env of the rendered Deployment, after its init
container's `mlflow db upgrade`. Only what is host-specific is filled in: the Secrets' contents (the
PostgreSQL URI, the S3 keys), the S3 endpoint, the port (a chart value) and the listen address
(127.0.0.1 instead of the pod's 0.0.0.0). A change to the chart's server command changes what runs here.

The tests skip, saying why, only where PostgreSQL cannot be installed or started. Every `kubealign`
process has a time limit (tests/faults/test_faults_registry.py's helpers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.test_chart import render
from tests.faults.test_faults_registry import (
    FAULT_TO_EXIT_S,
    aliases,
    evaluation,
    killing_the_server_after,
    kubealign_env,
    one_line_error,
    promote,
    promote_twice_at_once,
    run_together,
)
from tests.support.faults import FaultProxy, MlflowServer, free_port
from tests.support.stores import PostgresCluster, S3Server, container_env, ensure_postgresql, expand, process_env

# A PostgreSQL cluster, an S3 emulator and MLflow servers started per test, 5-6 minutes in all: a tier of its
# own (`make test-system`), apart from `make test` (it kept that over its time budget) and from CI.
pytestmark = [pytest.mark.faults, pytest.mark.system]

BUCKET = "mlflow-artifacts"
DB_SECRET, S3_SECRET = "mlflow-db", "minio"
# docs/deploy.md "Install the chart": the production values. Authentication off: the stores are what is tested here
# (with the MLflow UI in a browser); the authenticated registry, its identities and a DAG run as the pipeline
# identity are tests/faults/test_registry_auth.py's, on the chart's default stores.
PRODUCTION = {
    "auth": {"enabled": False},
    "backendStore": {"type": "postgresql", "existingSecret": DB_SECRET},
    "artifactStore": {
        "type": "s3",
        "s3Uri": f"s3://{BUCKET}",
        "s3EndpointUrl": "http://minio.example:9000",
        "existingSecret": S3_SECRET,
    },
}
MIGRATION_LIMIT_S = 180
# Concurrent promotes per run: with the lease and the duplicate check both broken on purpose, the second
# try was the first to register two versions; test_faults_registry.py runs 3 tries on the other stores.
TRIES = int(os.environ.get("KUBEALIGN_TEST_TRIES", "2"))
DAG_LIMIT_S = 900
LEASE_TAKES = (
    40  # per process; before the fix about 4 % of takes failed  # the shortened DAG takes about a minute on 2 cores
)


class Production:
    """The rendered pod's two containers, for `pg` and `s3`: `migration_argv`/`server_argv` and
    `migration_vars`/`server_vars` are what the containers get (argv with Kubernetes' $(VAR) expansion
    done); `migrate()` and `server` run them here, with this environment's `mlflow`."""

    def __init__(self, root: Path, pg: PostgresCluster, s3: S3Server):
        self.pg, self.s3 = pg, s3
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        deploy = next(d for d in render({"mlflow": {**PRODUCTION, "port": self.port}}) if d["kind"] == "Deployment")
        pod = deploy["spec"]["template"]["spec"]
        [init], [server] = pod["initContainers"], pod["containers"]
        secrets = {
            (DB_SECRET, "uri"): pg.uri,
            (S3_SECRET, "AWS_ACCESS_KEY_ID"): s3.ACCESS_KEY,
            (S3_SECRET, "AWS_SECRET_ACCESS_KEY"): s3.SECRET_KEY,
        }
        host = {"MLFLOW_S3_ENDPOINT_URL": s3.url}
        self.migration_vars, self.server_vars = container_env(init, secrets, host), container_env(server, secrets, host)
        self.migration_argv = expand(init["command"] + init["args"], self.migration_vars)
        self.server_argv = expand(server["command"] + server["args"], self.server_vars)
        # the pod listens on every address; here only loopback
        assert "--host=0.0.0.0" in self.server_argv, self.server_argv
        self.server_argv[self.server_argv.index("--host=0.0.0.0")] = "--host=127.0.0.1"
        self.migration = self._local(self.migration_argv)
        self.migration_env = process_env(self.migration_vars)
        local = self._local(self.server_argv)
        self.server = MlflowServer(root, command=local, env=process_env(self.server_vars), port=self.port)

    @staticmethod
    def _local(argv: list[str]) -> list[str]:
        """The image's `mlflow` on PATH is this environment's."""
        assert argv[0] == "mlflow", argv
        return [str(Path(sys.executable).with_name("mlflow")), *argv[1:]]

    def migrate(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.migration, env=self.migration_env, capture_output=True, text=True, timeout=MIGRATION_LIMIT_S
        )


@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory):
    reason = ensure_postgresql()
    if reason:
        pytest.skip(reason)
    pg = PostgresCluster()
    try:
        pg.start()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pg.stop()
        pytest.skip(f"a PostgreSQL cluster could not be started here: {exc}")
    s3 = S3Server(BUCKET).start()
    try:
        prod = Production(tmp_path_factory.mktemp("production"), pg, s3)
        started = time.perf_counter()
        done = prod.migrate()
        assert done.returncode == 0, done.stderr[-3000:]
        migrated = time.perf_counter()
        prod.server.start()
        print(f"\nmlflow db upgrade {migrated - started:.1f} s, server up {time.perf_counter() - migrated:.1f} s")
        yield prod
    finally:
        if "prod" in locals():
            prod.server.kill()
        s3.stop()
        pg.stop()


def test_the_init_container_migrated_postgresql_and_reruns_as_a_no_op(production: Production) -> None:
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    head = ScriptDirectory.from_config(_get_alembic_config(production.pg.uri)).get_current_head()
    assert production.pg.query("SELECT version_num FROM alembic_version") == [(head,)]
    tables = {row[0] for row in production.pg.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"experiments", "runs", "registered_models", "model_versions", "registered_model_aliases"} <= tables
    again = production.migrate()  # every rollout runs it: on a current schema it changes nothing
    assert again.returncode == 0, again.stderr[-3000:]
    assert production.pg.query("SELECT version_num FROM alembic_version") == [(head,)]
    # the other URI form the Secret may hold (MLflow's documented psycopg2 driver) opens the store too
    psycopg2 = [arg.replace("postgresql://", "postgresql+psycopg2://") for arg in production.migration]
    assert psycopg2 != production.migration
    done = subprocess.run(
        psycopg2, env=production.migration_env, capture_output=True, text=True, timeout=MIGRATION_LIMIT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_auth_tables_share_the_tracking_database(production: Production) -> None:
    """The chart's default for a PostgreSQL registry with authentication on: the basic-auth app's users and
    permissions in the tracking store's own database (mlflow.auth.databaseSecretKey empty). MLflow's auth
    migrations keep their own version table, and neither set of tables touches the other's."""
    from alembic.script import ScriptDirectory
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore
    from mlflow.store.db.utils import _get_alembic_config

    head = ScriptDirectory.from_config(_get_alembic_config(production.pg.uri)).get_current_head()
    SqlAlchemyStore().init_db(production.pg.uri)
    tables = {row[0] for row in production.pg.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"users", "registered_model_permissions", "alembic_version_auth", "registered_model_aliases"} <= tables
    assert production.pg.query("SELECT version_num FROM alembic_version") == [(head,)]
    again = production.migrate()  # and the tracking migration still finds its schema current
    assert again.returncode == 0, again.stderr[-3000:]


def test_two_replicas_migrating_a_new_store_at_once_end_with_the_schema_current(production: Production) -> None:
    """The chart's comment on its init container: replicas that start together on an empty database race
    in `mlflow db upgrade`; one may fail (measured: one of the two, 3 times of 3), and its retry (Kubernetes
    restarts a failed init container) finds the schema current."""
    import psycopg
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    pg = production.pg
    with psycopg.connect(pg.admin_uri("postgres"), autocommit=True, connect_timeout=10) as conn:
        conn.execute("CREATE DATABASE fresh")
    fresh = [arg.replace(pg.uri, pg.uri.rsplit("/", 1)[0] + "/fresh") for arg in production.migration]
    assert fresh != production.migration
    procs = [
        subprocess.Popen(
            fresh, env=production.migration_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        codes = [(p.communicate(timeout=MIGRATION_LIMIT_S), p.returncode)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert 0 in codes, codes  # one of them migrated
    for code in codes:
        if code != 0:  # the restarted init container
            retry = subprocess.run(
                fresh, env=production.migration_env, capture_output=True, text=True, timeout=MIGRATION_LIMIT_S
            )
            assert retry.returncode == 0, retry.stderr[-3000:]
    head = ScriptDirectory.from_config(_get_alembic_config(pg.uri)).get_current_head()
    with psycopg.connect(pg.admin_uri("fresh"), connect_timeout=10) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]


@pytest.fixture(scope="module")
def champion(production: Production, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A registered model whose version 1 `kubealign promote` made champion through the chart's server;
    its name. (One promotion for two tests: each takes 15-20 s here.)"""
    root, name = tmp_path_factory.mktemp("champion"), "prod-promote"
    done, _ = promote(production.server.url, name, evaluation(root, "e0", win=0.7, gain=0.3, reward=1.0), root / "p0")
    assert done.returncode == 0, done.stderr[-3000:]
    return name


def test_promote_registers_in_postgresql_with_its_files_in_the_bucket_and_loads_back(
    production: Production, champion: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, name = production.server.url, champion
    assert aliases(url, name)["champion"] == "1"
    # the registry is the PostgreSQL database ...
    rows = production.pg.query(f"SELECT version FROM model_versions WHERE name = '{name}' AND version = 1")
    assert rows == [(1,)]
    alias = f"SELECT version FROM registered_model_aliases WHERE name = '{name}' AND alias = 'champion'"
    assert production.pg.query(alias) == [(1,)]
    # ... and the model's files are objects in the bucket, written through the server
    keys = production.s3.object_keys()
    assert any(k.endswith("/MLmodel") for k in keys) and any(k.endswith(".safetensors") for k in keys), keys
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    replies = model.predict(["\n\nHuman: Tell me about cats.\n\nAssistant:"], params={"max_new_tokens": 4})
    assert len(replies) == 1 and isinstance(replies[0], str)


def test_concurrent_promotes_of_one_evaluation_register_one_version(production: Production, tmp_path: Path) -> None:
    """The promotion lease is a unique insert in PostgreSQL here (a row of registered_models)."""
    from mlflow.tracking import MlflowClient

    url, client = production.server.url, MlflowClient(production.server.url)
    for attempt in range(TRIES):
        promote_twice_at_once(url, client, f"prod-concurrent-{attempt}", tmp_path / f"try{attempt}", attempt)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, profile: Path, *what: str) -> str:
    """Headless chromium on `url` (MLflow's single-page UI: 20 s of virtual time to fetch and render);
    what it printed (the DOM for --dump-dom)."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,2000",
        "--virtual-time-budget=20000",
    ]
    done = subprocess.run([CHROMIUM, *flags, *what, url], capture_output=True, text=True, timeout=120)
    return done.stdout


def page_text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html.replace("&nbsp;", " ")))


LEASE_RACE = """
import sys, time
from mlflow.tracking import MlflowClient
from kubealign.promotion.aliases import error_code
from kubealign.promotion.lease import release, take_lease
client, lock, errors = MlflowClient(sys.argv[1]), sys.argv[2], []
for i in range(int(sys.argv[3])):
    owner = f"{sys.argv[4]}:{i}"
    try:
        while not take_lease(client, lock, owner):
            time.sleep(0.01)
        release(client, lock, owner)
    except Exception as exc:
        errors.append(error_code(exc) or type(exc).__name__)
print(errors)
"""


def test_taking_the_lease_while_its_holder_releases_it_is_no_error(production: Production) -> None:
    """Two processes take and release one lease in a loop. MLflow's SQL store answers a create that lost
    the unique insert by reading the row back; a release in between made that RESOURCE_DOES_NOT_EXIST,
    which failed a promote (5 of 120 takes here, before take_lease treated it as "free, try again")."""
    from mlflow.tracking import MlflowClient

    url, lock = production.server.url, "prod-race.promotion-lease"
    argvs = [[sys.executable, "-c", LEASE_RACE, url, lock, str(LEASE_TAKES), f"p{i}"] for i in range(2)]
    results = run_together(argvs, kubealign_env(url))
    for (out, err), code in results:
        assert code == 0 and out.strip() == "[]", (out, err[-2000:])
    assert not MlflowClient(url).search_registered_models(f"name = '{lock}'")


def test_the_server_killed_mid_promote_loses_no_champion(production: Production, champion: str, tmp_path: Path):
    from mlflow.tracking import MlflowClient

    server, name = production.server, champion
    before = aliases(server.url, name)
    assert before == {"champion": "1", "challenger": "1"}
    proxy = FaultProxy(server.url).start()
    try:
        proxy.rules.append(killing_the_server_after(server, proxy, "previous-champion", faults := []))
        best = evaluation(tmp_path, "best", win=0.9, gain=0.5, reward=1.5)
        done, ended = promote(proxy.url, name, best, tmp_path / "p1")
    finally:
        proxy.stop()
    assert proxy.dead, "the server was never killed: the promotion did not set previous-champion"
    line = one_line_error(done)
    assert "could not be put back" in line and "champion=1" in line, line
    assert faults and ended - faults[0] < FAULT_TO_EXIT_S, f"{ended - faults[0]:.1f} s from the fault to the exit"
    assert not (tmp_path / "p1").exists()

    server.start()  # the same command on the same PostgreSQL database and bucket, as a restarted pod
    # half-moved, but the champion never moved; the journal in PostgreSQL holds what they were
    assert aliases(server.url, name) == {"champion": "1", "previous-champion": "1", "challenger": "2"}
    journal = json.loads(MlflowClient(server.url).get_registered_model(name).tags["kubealign.alias_journal"])
    assert {a: str(v) for a, v in journal["before"].items() if v is not None} == before
    # the next promotion (one that fails the gate) first puts the aliases back as they were
    worse = evaluation(tmp_path, "worse", win=0.3, gain=0.3, reward=1.0)
    done, _ = promote(server.url, name, worse, tmp_path / "p2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "put back aliases left half-moved" in done.stderr
    assert aliases(server.url, name) == {"champion": "1", "challenger": "3"}


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_mlflow_ui_shows_the_champion_and_the_promote_runs_metrics(
    production: Production, champion: str, tmp_path: Path
) -> None:
    """The chart's server's own UI in a real browser: the registered model's page shows `@ champion` on
    the champion's version row only, and the run page of the promote stage that registered it shows its
    metrics. (After the killed-promote test, when the model has three versions.)"""
    from mlflow.tracking import MlflowClient

    url, client = production.server.url, MlflowClient(production.server.url)
    versions = client.search_model_versions(f"name = '{champion}'")
    champion_version = str(client.get_model_version_by_alias(champion, "champion").version)
    model_page = f"{url}/#/models/{champion}"
    shot = tmp_path / "registered-model.png"
    browse(model_page, tmp_path / "profile", f"--screenshot={shot}")
    dom = browse(model_page, tmp_path / "profile", "--dump-dom")
    rows = [page_text(row) for row in dom.split('role="row"')[2:]]  # [0] before the table, [1] its header
    assert len(rows) == len(versions), rows
    for row in rows:
        version = re.search(r"Version (\d+)", row).group(1)
        assert ("@ champion" in row) == (version == champion_version), row
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 2000)  # tall enough for three versions' rows
    dark = sum(1 for x in range(0, 1400, 3) for y in range(0, 2000, 3) if sum(image.getpixel((x, y))) < 200)
    assert dark > 500  # the page was drawn, not a blank or error screen

    run = client.get_run(client.get_model_version(champion, champion_version).run_id)
    text = page_text(
        browse(
            f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}", tmp_path / "profile", "--dump-dom"
        )
    )
    metrics = text[text.index(f"Metrics ({len(run.data.metrics)})") : text.index("Parameters (")]
    for key, value in run.data.metrics.items():
        assert f" {key} {value:g}" in metrics or f" {key} {value!r}" in metrics, (key, value, metrics)


# 79 s here beside another job (127-172 s under a heavier one): inside make test, as the issue asks
def test_the_shortened_dag_tracks_and_registers_on_the_production_stores(
    production: Production, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kubealign run` (kfp.local, the kfp tier's shortened DAG) tracking to the chart's server: every
    stage's run and metrics in PostgreSQL, their artifacts and the registered model in the bucket."""
    from mlflow.tracking import MlflowClient

    from tests.pipelines.test_kfp_local import STAGES, overrides

    url, name = production.server.url, "prod-dag"
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "kubealign.cli",
        "run",
        *overrides(),
        "--set",
        f"promote.registered_model={name}",
        "--output",
        str(out),
    ]
    done = subprocess.run(command, env=kubealign_env(url), capture_output=True, text=True, timeout=DAG_LIMIT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    index = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert index["succeeded"] and list(index["stages"]) == STAGES
    assert index["mlflow"]["tracking_uri"] == url
    client = MlflowClient(url)
    parent = index["mlflow"]["parent_run_id"]
    children = client.search_runs([index["mlflow"]["experiment_id"]], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.data.tags["kubealign.stage"] for r in children) == sorted(STAGES)
    sft = next(r for r in children if r.data.tags["kubealign.stage"] == "sft")
    assert sft.data.metrics["after_perplexity"] < sft.data.metrics["before_perplexity"]
    # the runs and their metrics are rows of the PostgreSQL store
    stored = production.pg.query(f"SELECT key FROM metrics WHERE run_uuid = '{sft.info.run_id}'")
    assert {"after_perplexity", "before_perplexity"} <= {row[0] for row in stored}
    assert aliases(url, name) == {"champion": "1", "challenger": "1"}
    # artifacts of the pipeline's runs are objects in the bucket
    keys = production.s3.object_keys()
    assert any(parent in k and k.endswith("config/resolved.json") for k in keys), keys[:20]
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    source = client.get_model_version(name, "1").source
    tree = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@champion", dst_path=str(tmp_path / "dl")))
    assert (tree / "MLmodel").exists(), source
