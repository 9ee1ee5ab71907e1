"""A stage's MLflow run: where it goes, how it starts and ends, and what a tracking failure costs.

Where runs go is decided by the environment, the way MLflow and KFP's MLflow integration expect:

* MLFLOW_TRACKING_URI (else `tracking.uri`, else a sqlite store `<output root>/mlflow.db` with
  artifacts in `<output root>/mlartifacts`, where the output root is the parent of `--output`; not in a
  Kubernetes pod, whose filesystem goes with it: there no URI is a one-line error);
  a URI holding credentials (`https://user:password@host`) is refused: the config is copied into the
  compiled pipeline and into MLflow params, so credentials go in MLFLOW_TRACKING_USERNAME /
  MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), on a cluster from `kubernetes.mlflow_secret`;
* MLFLOW_EXPERIMENT_ID / MLFLOW_EXPERIMENT_NAME (else `tracking.experiment`);
* MLFLOW_RUN_ID: log into that existing run (as injected for a KFP task) and leave its status to
  whoever created it;
* KUBEALIGN_PARENT_RUN_ID: create this stage's run nested under that run (tag mlflow.parentRunId),
  which is how one pipeline run holds a run per stage across processes.

Two failure policies (`stage_run(required=...)`):

* required (the default; promote and rollback, whose whole point is the registry): every call is
  synchronous and a tracking failure is an error of the stage (UserError, exit code 2).
* best effort (the training and evaluation stages): tracking never costs a trained model. The run is
  created at the start, synchronously, and a failure there is still a one-line error: nothing has been
  computed yet, and a mistyped URI is better reported in seconds than after hours of untracked
  training. From then on every call is queued for one writer thread (BackgroundTracker) and the stage
  never waits on MLflow: short, bounded HTTP retries (HTTP_SETTINGS), one warning line when the server
  goes away, a new try every RETRY_DOWN_S, one more at the end, then one warning line and exit 0.
  Every metric is also kept in `tracker.history`, which the stages write into result.json
  ("tracked_metrics"), so nothing is lost when MLflow is.

Bad input writes nothing: when a stage stops on a UserError (exit 2), the parts of the default store that this
command created (mlflow.db, mlartifacts, the output root) are removed again, if they hold no run but this
stage's (another stage may have started in the same store meanwhile); a store that was there stays.

Only rank 0 (env RANK) logs; other ranks get a NullTracker. mlflow is imported lazily: it is slow to
import and a disabled tracker must not need it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubealign.config import KubealignConfig, config_to_yaml, flatten
from kubealign.errors import Stopped, UserError, auth_hint, first_line
from kubealign.ranks import is_main
from kubealign.tracking.trackers import BackgroundTracker, MlflowTracker, NullTracker, warn

PARENT_RUN_ENV = "KUBEALIGN_PARENT_RUN_ID"

# MLflow's own HTTP retry policy, read on every request, defaults to 7 retries with exponential backoff
# and a 120 s timeout: ~4 minutes per call against a dead server. A best-effort stage sets these unless
# the environment already does: a dead server costs ~3 s per call, a hung one at most ~33 s.
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def check_uri(uri: str | None, source: str) -> None:
    """Refuse credentials inside a tracking URI; `source` names where it came from."""
    if not uri:
        return
    try:
        parts = urlsplit(uri)
        user, password = parts.username, parts.password
    except ValueError:
        return  # not a URL MLflow could use either; MLflow reports it
    if password is None and not (user and parts.scheme in ("http", "https")):
        return  # e.g. postgresql://user@host/db with PGPASSWORD: a name, not a secret
    shown = uri.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)
    raise UserError(
        f"{source} {shown}: credentials do not belong in a tracking URI (it is copied into the compiled "
        "pipeline, MLflow params and logs); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
        "(or MLFLOW_TRACKING_TOKEN) in the environment instead, on a cluster through kubernetes.mlflow_secret"
    )


def resolve_uri(config: KubealignConfig) -> str | None:
    """MLFLOW_TRACKING_URI, else `tracking.uri`, else None; credentials in either are refused."""
    check_uri(config.tracking.uri, "tracking.uri")
    env = os.environ.get("MLFLOW_TRACKING_URI")
    check_uri(env, "MLFLOW_TRACKING_URI")
    return env or config.tracking.uri


def default_store(output_root: Path) -> tuple[str, str]:
    """(tracking URI, artifact location URI) of the local default store under output_root."""
    root = output_root.resolve()
    return f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()


def resolve_experiment(client: Any, name: str, artifact_location: str | None) -> str:
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or name
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as exc:  # two stages starting at once: the other one created it first
        if exc.error_code != "RESOURCE_ALREADY_EXISTS" or (found := client.get_experiment_by_name(name)) is None:
            raise
        return found.experiment_id


@contextlib.contextmanager
def http_settings(settings: dict[str, str]) -> Iterator[None]:
    """Set MLflow's HTTP environment variables the environment does not set, for the duration."""
    added = [key for key in settings if key not in os.environ]
    os.environ.update({key: settings[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def stage_run(stage: str, config: KubealignConfig, output_root: Path, required: bool = True) -> Iterator[NullTracker]:
    """An MLflow run for one stage: params and the resolved config YAML logged on entry, status set to
    FINISHED, FAILED or KILLED (Stopped: a signal, with a checkpoint) on exit (except for an attached
    MLFLOW_RUN_ID run, whose owner ends it).

    A failure to start the run is a UserError either way. `required=False` (training, evaluation) then
    yields a BackgroundTracker: tracking failures cost a warning line, never the stage (see the module
    docstring). `required=True` (the default; promote) yields a synchronous tracker, and failing to end
    the run fails the stage. Ending the run never raises over the stage's own error."""
    if not config.tracking.enabled or not is_main():
        yield NullTracker()
        return
    uri = resolve_uri(config)
    created = [] if uri else _missing(output_root)
    run_id, status = None, "FAILED"
    try:
        with contextlib.ExitStack() as stack:
            if not required:
                stack.enter_context(http_settings(HTTP_SETTINGS))
            sender, attached = _start(stage, config, uri, output_root)
            run_id = sender.run_id
            tracker = sender if required else BackgroundTracker(sender)
            status = "FINISHED"
            try:
                yield tracker
            except Stopped:  # stopped on a signal with a checkpoint: MLflow's KILLED, not a failure
                status = "KILLED"
                raise
            except BaseException:
                status = "FAILED"
                raise
            finally:
                _end(tracker, sender, attached, status, required)
    except UserError:
        if status == "FAILED":  # bad input; not a run that finished and then failed to end (promote's registry)
            _remove_created(created, run_id)
        raise


def _missing(output_root: Path) -> list[Path]:
    """The paths of the default store under output_root that do not exist yet, deepest last: the output root
    and its missing parents, mlflow.db and mlartifacts."""
    root = output_root.resolve()
    dirs = [p for p in (root, *root.parents) if not p.exists()]
    return [*reversed(dirs), *(p for p in (root / "mlflow.db", root / "mlartifacts") if not p.exists())]


def _runs_in(db: Path) -> set[str] | None:
    """The run ids of the sqlite store `db` (None when it cannot be read or holds a registered model: then
    it is kept)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            if conn.execute("SELECT COUNT(*) FROM registered_models").fetchone()[0]:
                return None
            return {row[0] for row in conn.execute("SELECT run_uuid FROM runs")}
    except sqlite3.Error:
        return set() if db.stat().st_size == 0 else None


def _remove_created(created: list[Path], run_id: str | None) -> None:
    """Remove what this command created of the default store (see the module docstring), never more: a store
    holding another run stays, and a directory is removed only once empty."""
    db = next((p for p in created if p.name == "mlflow.db"), None)
    if db is not None and db.exists():
        runs = _runs_in(db)
        if runs is None or runs - {run_id}:
            return  # another stage logs into the store this command made: all of it stays
        _forget_store(f"sqlite:///{db}")
        for path in (db, *(db.with_name(db.name + tail) for tail in ("-journal", "-wal", "-shm"))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    artifacts = next((p for p in created if p.name == "mlartifacts"), None)
    # the experiment's artifact location holds a directory per run
    if artifacts is not None and artifacts.is_dir() and {p.name for p in artifacts.iterdir()} <= {run_id}:
        shutil.rmtree(artifacts, ignore_errors=True)
    for directory in reversed([p for p in created if p.name not in ("mlflow.db", "mlartifacts")]):
        with contextlib.suppress(OSError):  # not empty: something else wrote there
            directory.rmdir()


def _forget_store(uri: str) -> None:
    """Drop MLflow's cached store and engine of `uri`, whose file is about to go: a later stage of this
    process then makes a new one instead of writing through a pool of connections to the removed file."""
    with contextlib.suppress(Exception):  # MLflow internals: a version without them has nothing to drop
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry._get_store_with_resolved_uri.cache_clear()
        engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()


IN_A_POD_ENV = "KUBERNETES_SERVICE_HOST"  # the kubelet sets it in every container of a Kubernetes pod


def _start(stage: str, config: KubealignConfig, uri: str | None, output_root: Path) -> tuple[MlflowTracker, bool]:
    from mlflow.tracking import MlflowClient

    artifact_location = None
    if not uri and os.environ.get(IN_A_POD_ENV):
        # a store in the pod's own filesystem is gone with the pod: the run would be lost without a word. On a
        # cluster the URI comes from the pod's MLflow Secret (kubealign.cluster.secrets.pod_secrets), and a
        # Secret that is absent is skipped by Kubernetes (optional), so say which ones to look at.
        raise UserError(
            f"MLflow tracking: this pod has no MLFLOW_TRACKING_URI and tracking.uri is unset, so {stage}'s run "
            f"would be lost with the pod: check the Secret kubernetes.mlflow_secret names (pods that run reward "
            f"functions read kubernetes.tracking_secret's; the chart makes both), or set tracking.uri, or "
            f"tracking.enabled: false"
        )
    if not uri:
        output_root.mkdir(parents=True, exist_ok=True)
        uri, artifact_location = default_store(output_root)
    attached = os.environ.get("MLFLOW_RUN_ID")
    try:
        client = MlflowClient(tracking_uri=uri)
        if attached:
            run_id = client.get_run(attached).info.run_id
        else:
            experiment_id = resolve_experiment(client, config.tracking.experiment, artifact_location)
            parent = os.environ.get(PARENT_RUN_ENV)
            tags = {"mlflow.parentRunId": parent} if parent else {}
            run_id = client.create_run(experiment_id, run_name=stage, tags=tags).info.run_id
        tracker = MlflowTracker(client, run_id, uri)
        tracker.set_tags({"kubealign.stage": stage, **config.feedback.round_tags})  # the round: docs/feedback.md
        tracker.log_params(flatten(config))
        tracker.log_text(config_to_yaml(config), "config/resolved.yaml")
    except Exception as exc:  # a bad URI, an unreachable server, a permission problem
        raise UserError(f"MLflow tracking at {uri}: {first_line(exc)}{auth_hint(exc)}") from None
    return tracker, bool(attached)


def _end(tracker: NullTracker, sender: MlflowTracker, attached: bool, status: str, required: bool) -> None:
    """Send what is left and end the run; report a failure as one line. Raises (a UserError) only for
    a required run whose stage succeeded."""
    problem, down = None, False
    if isinstance(tracker, BackgroundTracker):
        down = not tracker.close()
        if down:
            problem = (
                f"stayed unreachable: the run is incomplete, {tracker.pending + tracker.dropped} logging call(s) "
                f"not sent (last error: {tracker.error or 'timed out'})"
            )
        elif tracker.dropped:
            problem = f"{tracker.dropped} logging call(s) not sent (last error: {tracker.error or 'queue full'})"
    if not attached and not down:  # a server that just failed the last try would only fail this too
        try:
            sender.terminate(status)
        except Exception as exc:
            problem = f"could not mark the run {status} ({first_line(exc)})"
    if problem is None:
        return
    message = f"MLflow tracking at {sender.tracking_uri}, run {sender.run_id}: {problem}"
    if required and status == "FINISHED":
        raise UserError(message)
    warn(message + ("; the stage's result.json holds its metrics" if not required else ""))
