"""The trackers a stage logs through (kubealign.tracking.runs decides which one and where runs go): NullTracker
(disabled, or a rank other than 0), MlflowTracker (synchronous: a failure is the stage's error) and
BackgroundTracker (best effort: one writer thread, bounded queue, the stage never waits on MLflow)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from kubealign.errors import first_line

QUEUE_LIMIT = 20_000  # queued calls; when full, the oldest is dropped (its metrics stay in the history)
BATCH_METRICS = 1000  # the REST API's limit on metrics in one log_batch
RETRY_DOWN_S = 60.0  # while the server is down, how often the writer tries again
FLUSH_TIMEOUT_S = 30.0  # longest a checkpoint waits for the queue to drain
CLOSE_TIMEOUT_S = 90.0  # longest the end of a stage waits for the last sends


def warn(message: str) -> None:
    """One line on stderr, above any progress bar."""
    from tqdm import tqdm

    tqdm.write(f"kubealign: warning: {message}", file=sys.stderr)


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

    def log_inputs(self, refs: list[Any]) -> None:
        """The datasets the run read (tracking.lineage.DatasetRef)."""

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

    def log_inputs(self, refs: list[Any]) -> None:
        from kubealign.tracking.lineage import entities

        if refs:
            self._client.log_inputs(self.run_id, datasets=entities(refs))

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

    def log_inputs(self, refs: list[Any]) -> None:
        self._put("inputs", list(refs))

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
        elif kind == "inputs":
            self._sender.log_inputs(payload)
        else:
            self._sender.log_artifact(*payload)
