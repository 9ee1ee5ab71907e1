"""MLflow tracking behind one small interface.

Where runs go is decided by the environment, the way MLflow and KFP's MLflow integration expect:

* MLFLOW_TRACKING_URI (else `tracking.uri`, else a sqlite store `<output root>/mlflow.db` with
  artifacts in `<output root>/mlartifacts`, where the output root is the parent of `--output`);
* MLFLOW_EXPERIMENT_ID / MLFLOW_EXPERIMENT_NAME (else `tracking.experiment`);
* MLFLOW_RUN_ID: log into that existing run (as injected for a KFP task) and leave its status to
  whoever created it;
* KUBEALIGN_PARENT_RUN_ID: create this stage's run nested under that run (tag mlflow.parentRunId),
  which is how one pipeline run holds a run per stage across processes.

Only rank 0 (env RANK) logs; other ranks get a NullTracker. mlflow is imported lazily: it is slow to
import and a disabled tracker must not need it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_to_yaml, flatten
from kubealign.errors import UserError, first_line

PARENT_RUN_ENV = "KUBEALIGN_PARENT_RUN_ID"


class NullTracker:
    """Does nothing: tracking disabled, or a rank other than 0."""

    run_id: str | None = None
    tracking_uri: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...


class MlflowTracker(NullTracker):
    """Logs into one MLflow run through MlflowClient (no global fluent state, so an attached run and
    a nested run are handled the same way)."""

    def __init__(self, client: Any, run_id: str, tracking_uri: str):
        self._client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # the REST API takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self._client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, value)


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


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
    return client.create_experiment(name, artifact_location=artifact_location)


@contextlib.contextmanager
def stage_run(stage: str, config: KubealignConfig, output_root: Path) -> Iterator[NullTracker]:
    """An MLflow run for one stage: params and the resolved config YAML logged on entry, status set to
    FINISHED or FAILED on exit (except for an attached MLFLOW_RUN_ID run, whose owner ends it)."""
    if not config.tracking.enabled or not is_rank_zero():
        yield NullTracker()
        return
    from mlflow.tracking import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.tracking.uri
    artifact_location = None
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
        tracker.set_tags({"kubealign.stage": stage})
        tracker.log_params(flatten(config))
        tracker.log_text(config_to_yaml(config), "config/resolved.yaml")
    except Exception as exc:  # a bad URI, an unreachable server, a permission problem
        raise UserError(f"MLflow tracking at {uri}: {first_line(exc)}") from None
    status = "FINISHED"
    try:
        yield tracker
    except BaseException:
        status = "FAILED"
        raise
    finally:
        if not attached:
            client.set_terminated(run_id, status)
