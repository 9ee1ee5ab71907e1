"""MLflow tracking behind one small interface.

Where runs go is decided by the environment, the way MLflow and KFP's MLflow integration expect:

* MLFLOW_TRACKING_URI (else `tracking.uri`, else a sqlite store `<output root>/mlflow.db` with
  artifacts in `<output root>/mlartifacts`, where the output root is the parent of `--output`);
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

Only rank 0 (env RANK) logs; other ranks get a NullTracker. mlflow is imported lazily: it is slow to
import and a disabled tracker must not need it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubealign.config import KubealignConfig, config_to_yaml, flatten
from kubealign.errors import Stopped, UserError, first_line

PARENT_RUN_ENV = "KUBEALIGN_PARENT_RUN_ID"

# MLflow's own HTTP retry policy, read on every request, defaults to 7 retries with exponential backoff
# and a 120 s timeout: ~4 minutes per call against a dead server. A best-effort stage sets these unless
# the environment already does: a dead server costs ~3 s per call, a hung one at most ~33 s.
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
QUEUE_LIMIT = 20_000  # queued calls; when full, the oldest is dropped (its metrics stay in the history)
BATCH_METRICS = 1000  # the REST API's limit on metrics in one log_batch
RETRY_DOWN_S = 60.0  # while the server is down, how often the writer tries again
FLUSH_TIMEOUT_S = 30.0  # longest a checkpoint waits for the queue to drain
CLOSE_TIMEOUT_S = 90.0  # longest the end of a stage waits for the last sends


def warn(message: str) -> None:
    """One line on stderr, above any progress bar."""
    from tqdm import tqdm

    tqdm.write(f"kubealign: warning: {message}", file=sys.stderr)


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


class NullTracker:
    """Sends nothing (tracking disabled, or a rank other than 0); keeps the metric history all the same."""

    run_id: str | None = None
    tracking_uri: str | None = None

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []  # every log_metrics call: {"step": step, **metrics}

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait (at most `timeout` s) until what was logged has been sent; True when it has."""
        return True


class MlflowTracker(NullTracker):
    """Logs into one MLflow run through MlflowClient (no global fluent state, so an attached run and
    a nested run are handled the same way). Synchronous: a failure raises."""

    def __init__(self, client: Any, run_id: str, tracking_uri: str):
        super().__init__()
        self._client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # the REST API takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        self.send_metrics(metric_entities(metrics, step))

    def send_metrics(self, items: list[Any]) -> None:
        for i in range(0, len(items), BATCH_METRICS):
            self._client.log_batch(self.run_id, metrics=items[i : i + BATCH_METRICS])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def terminate(self, status: str) -> None:
        self._client.set_terminated(self.run_id, status)


def metric_entities(metrics: dict[str, float], step: int | None) -> list[Any]:
    """MLflow Metric entities stamped now (when logged, not when a queue gets to send them)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]


def transient(exc: BaseException) -> bool:
    """A failure worth trying again later (server down, hung, overloaded), as opposed to a call the
    server refuses (bad value, deleted run), which would fail the same way every time."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return True  # connection errors, timeouts, OS errors
    status = exc.get_http_status_code()  # MLflow reports an unreachable server as INTERNAL_ERROR (500)
    return status >= 500 or status == 429


class BackgroundTracker(NullTracker):
    """Best-effort tracking off the training path.

    Every call returns at once: it is queued (with its timestamp) for one writer thread, which sends
    the queue in order, consecutive metric calls merged into one log_batch. The queue is bounded
    (QUEUE_LIMIT calls); when it is full the oldest call is dropped and counted, never the caller
    blocked, and its metrics stay in `history`. When the server fails (after MLflow's short retries,
    see HTTP_SETTINGS) the call goes back to the front of the queue, one warning line is printed and
    the writer tries again every `retry_s`; a call the server refuses (a 4xx) is dropped with a
    warning. `close()` makes one more try of whatever is left.
    """

    def __init__(self, sender: MlflowTracker, limit: int = QUEUE_LIMIT, retry_s: float = RETRY_DOWN_S):
        super().__init__()
        self._sender = sender
        self.run_id, self.tracking_uri = sender.run_id, sender.tracking_uri
        self._limit, self._retry_s = limit, retry_s
        self._queue: deque[tuple[str, Any]] = deque()
        self._cond = threading.Condition()
        self._sending = 0  # calls taken by the writer and not yet settled
        self._closing = False
        self._down_at: float | None = None  # when the last try failed, while the server is down
        self.dropped = 0  # calls not sent: queue full, or refused by the server
        self.error: str | None = None  # the last failure, one line
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._write, name="kubealign-tracking", daemon=True)
        self._thread.start()

    def log_params(self, params: dict[str, Any]) -> None:
        self._put("params", dict(params))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        self._put("metrics", metric_entities(metrics, step))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._put("artifact", (Path(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._put("text", (text, artifact_file))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put("tags", dict(tags))

    @property
    def pending(self) -> int:
        """Calls logged and not (yet) sent."""
        with self._cond:
            return len(self._queue) + self._sending

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until the queue is sent, at most `timeout` s, and not at all while the server is down."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._sending) and self._down_at is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return not self._queue and not self._sending

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Send what is left (one more try if the server was down) and stop the writer; True when
        everything logged was sent. Never raises."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            return not self._thread.is_alive() and not self._queue and not self._sending

    def _put(self, kind: str, payload: Any) -> None:
        with self._cond:
            if len(self._queue) >= self._limit:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((kind, payload))
            self._cond.notify_all()

    def _take(self) -> list[tuple[str, Any]]:
        """The next call, with the metric calls right behind it when it is one (up to BATCH_METRICS)."""
        batch = [self._queue.popleft()]
        if batch[0][0] == "metrics":
            count = len(batch[0][1])
            while self._queue and self._queue[0][0] == "metrics" and count + len(self._queue[0][1]) <= BATCH_METRICS:
                batch.append(self._queue.popleft())
                count += len(batch[-1][1])
        return batch

    def _ready(self) -> bool:
        if not self._queue:
            return False
        return self._closing or self._down_at is None or time.monotonic() - self._down_at >= self._retry_s

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._ready():
                    if self._closing:
                        return  # nothing left to send
                    wait = None if self._down_at is None else self._retry_s - (time.monotonic() - self._down_at)
                    self._cond.wait(None if wait is None else max(wait, 0.0))
                batch = self._take()
                self._sending = len(batch)
            try:
                self._send(batch)
                failure = None
            except Exception as exc:  # a writer thread that died would silently stop tracking
                failure = exc
            with self._cond:
                self._sending = 0
                self._settle(batch, failure)
                self._cond.notify_all()
                if failure is not None and self._closing and transient(failure):
                    return  # the last try failed: stop here, close() reports it

    def _settle(self, batch: list[tuple[str, Any]], failure: Exception | None) -> None:
        if failure is None:
            self._down_at = None
            return
        self.error = first_line(failure)
        if transient(failure):
            self._queue.extendleft(reversed(batch))
            self._down_at = time.monotonic()
            self._warn_once(
                "down",
                f"MLflow tracking at {self.tracking_uri} is unreachable ({self.error}); the stage goes on, "
                "keeps its metrics in its outputs and tries again later",
            )
        else:
            self.dropped += len(batch)
            self._warn_once("refused", f"MLflow at {self.tracking_uri} refused a tracking call: {self.error}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def _send(self, batch: list[tuple[str, Any]]) -> None:
        kind, payload = batch[0]
        if kind == "metrics":
            self._sender.send_metrics([metric for _, metrics in batch for metric in metrics])
        elif kind == "params":
            self._sender.log_params(payload)
        elif kind == "tags":
            self._sender.set_tags(payload)
        elif kind == "text":
            self._sender.log_text(*payload)
        else:
            self._sender.log_artifact(*payload)


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
    if not config.tracking.enabled or not is_rank_zero():
        yield NullTracker()
        return
    uri = resolve_uri(config)
    with contextlib.ExitStack() as stack:
        if not required:
            stack.enter_context(http_settings(HTTP_SETTINGS))
        sender, attached = _start(stage, config, uri, output_root)
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


def _start(stage: str, config: KubealignConfig, uri: str | None, output_root: Path) -> tuple[MlflowTracker, bool]:
    from mlflow.tracking import MlflowClient

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
