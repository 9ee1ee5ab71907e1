"""The seam through which `kubealign run` sees kfp.local's tasks: when each starts and ends, and
everything it prints.

kfp.local (2.13-2.17) has no API for either. Its SubprocessRunner runs a task's executor with
`kfp.local.subprocess_task_handler.run_local_subprocess(full_command, env_vars)`, which copies the
subprocess's merged stdout/stderr to print() line by line and returns the exit code; its DAG
orchestrators run every task, cache lookup included, through
`kfp.local.orchestrator.task_executor.execute_single_task(task_name=..., ...)`, which returns
(outputs, status). Both are module attributes looked up at call time, so `capture()` replaces them
for one run and puts them back after:

* execute_single_task: which task is current; when it returns, whether it ran, was cached or failed;
* run_local_subprocess: the same subprocess, its output written to LOG_DIR/<task>.log (and echoed, as
  kfp.local does, when verbose), the last tqdm progress it printed passed to the display.
* docker_task_handler.run_docker_container (DockerRunner): the same for a container, which is never
  pulled (an image missing from the daemon is an error naming it) and removed only after its exit code
  is read — kfp.local's own auto-removes it and reports a container gone before `wait` as a success.
* OrchestratorUtils.get_dag_output_artifacts: kfp.local resolves a `dsl.OneOf` of parameters but
  raises on a `dsl.OneOf` of artifacts ("Expected 1 artifact in ArtifactSelectorSpec"), which the DAG's
  algorithm branches use; the replacement takes the one branch that produced the artifact, as kfp.local
  already does for parameters and as the KFP backend does.
* OrchestratorUtils.make_task_arguments: a task marked `.ignore_upstream_failure()` (the route comparison)
  runs after an upstream task failed, as it should, but kfp.local then raises looking for the failed
  task's output ("task ... not found") instead of leaving the optional input at its default, which is
  what the compiler's check for such tasks (inputs from upstream must be optional) promises; the
  replacement drops artifact inputs whose producer failed or was skipped, so the default (None) applies.

tests/pipelines/test_run_output.py fails if kfp changes either seam (names, parameters, or how they are called).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubealign.pipelines.progress import (
    CACHED,
    DONE,
    FAILED,
    RUNNING,
    STOPPED,
    Display,
    Lines,
    last_error_line,
    progress_of,
)

TAIL_BYTES = 64 * 1024  # how much of a failed task's log is searched for its error line


@dataclass
class TaskRecord:
    """How one task of the run ended."""

    name: str
    status: str = RUNNING
    log: Path | None = None
    returncode: int | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    wall_time_s: float | None = None  # from kfp.local handing the task over to its return, as the user waited

    def error_line(self) -> str:
        """The last error line of the task's log, else its exit code."""
        lines: list[str] = []
        if self.log is not None and self.log.is_file():
            with self.log.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - TAIL_BYTES))
                lines = log.read().decode("utf-8", "replace").splitlines()
        found = last_error_line(lines)
        if found:
            return found
        return f"exit code {self.returncode}" if self.returncode is not None else "no output"


class Capture:
    """Replacement bodies for the two kfp.local seams, for one pipeline run (tasks run one at a time:
    kfp.local's orchestrators are sequential)."""

    def __init__(self, log_dir: Path, display: Display | None, echo: bool):
        self.log_dir, self.display, self.echo = log_dir, display, echo
        self.records: dict[str, TaskRecord] = {}
        self._current: TaskRecord | None = None
        self.interrupted = False
        self.live: dict[int, str] = {}  # pid (= its process group: a session of its own) -> task name
        self.stopped: list[str] = []
        self.signalled: set[int] = set()  # the process groups sent SIGTERM
        self._lock = threading.RLock()  # the signal handler runs in the main thread, maybe inside a `with`

    def _show(self, name: str, **changes: Any) -> None:
        if self.display is not None:
            self.display.update(name, **changes)

    def execute_single_task(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        name = kwargs["task_name"] if "task_name" in kwargs else args[0]
        if self.interrupted:  # a task kfp.local starts after Ctrl-C: not run
            raise Interrupted()
        record = self._current = self.records[name] = TaskRecord(name)
        started = time.perf_counter()
        try:
            outputs, status = original(*args, **kwargs)
        except BaseException:
            record.wall_time_s = time.perf_counter() - started
            record.status = STOPPED if self.interrupted else FAILED
            self._show(name, status=record.status, log=record.log)
            raise
        record.wall_time_s = time.perf_counter() - started
        ok = getattr(status, "name", status) == "SUCCESS"
        if record.log is None and ok:  # no subprocess ran: kfp.local's cache had the outputs
            record.status, record.log = CACHED, self._cached_log(name, outputs)
        elif self.interrupted and not ok:
            record.status = STOPPED
        else:
            record.status = DONE if ok else FAILED
        record.outputs = dict(outputs or {})
        self._show(name, status=record.status, log=record.log)
        if self.interrupted:  # out of kfp.local's orchestrator, whichever thread runs this task
            raise Interrupted()
        return outputs, status

    def run_local_subprocess(self, full_command: list[str], env_vars: dict[str, str] | None = None) -> int:
        """kfp.local's run_local_subprocess, with the output going to the task's log."""
        record = self._current or TaskRecord("task")
        first = record.log is None
        record.log = self.log_dir / f"{record.name}.log"
        self._show(record.name, status=RUNNING, log=record.log)
        # unbuffered: the task's prints reach its log when they happen, in order with its stderr
        env = {**os.environ, **(env_vars or {}), "PYTHONUNBUFFERED": "1"}
        lines = Lines()
        # a session of its own: a Ctrl-C at the terminal reaches `kubealign run` alone, which stops each task
        # (stop) as a cluster would, SIGTERM first so that a training stage saves a checkpoint
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "env": env, "start_new_session": True}
        with (
            record.log.open("w" if first else "a", encoding="utf-8", buffering=1) as log,
            subprocess.Popen(full_command, **popen) as process,
        ):
            assert process.stdout is not None
            with self._lock:
                self.live[process.pid] = record.name
            if self.interrupted:  # Ctrl-C came while it started
                _signal_group(process.pid, signal.SIGKILL)
            try:  # read to the end after a Ctrl-C too: what a stopping stage says (its checkpoint) is logged
                while chunk := process.stdout.read1(65536):
                    for line in lines.feed(chunk):
                        self._line(record.name, line, log)
                for line in lines.close():
                    self._line(record.name, line, log)
                record.returncode = process.wait()
            finally:
                with self._lock:
                    self.live.pop(process.pid, None)
        return record.returncode

    def interrupt(self, grace: float) -> None:
        """Ctrl-C (SIGINT) or SIGTERM to `kubealign run`: no task starts any more; each running one gets
        SIGTERM (a training stage checkpoints, as on preemption), its process group SIGKILL after `grace` s."""
        if self.interrupted:  # a second signal: no more waiting
            self.kill()
            return
        self.interrupted = True
        with self._lock:
            live = dict(self.live)
        self.stopped = sorted(set(live.values()))
        self.signalled = set(live)
        for pid in live:
            _signal_group(pid, signal.SIGTERM)
        killer = threading.Timer(grace, self.kill)
        killer.daemon = True
        killer.start()

    def kill(self) -> None:
        """SIGKILL to every task's process group still alive, and to any process it left behind."""
        with self._lock:
            live = list(self.live)
        for pid in live:
            for child in _descendants(pid):
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        for pid in {*live, *self.signalled}:  # a group outlives its leader: what the task left in it
            _signal_group(pid, signal.SIGKILL)

    def wait_stopped(self, grace: float) -> None:
        """Return once no task process is left (SIGKILL to what remains after `grace` s)."""
        deadline = time.monotonic() + grace
        while self.live and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()

    def run_docker_container(
        self, client: Any, image: str, command: list[str], volumes: dict[str, Any], **run_args: Any
    ) -> int:
        """kfp.local's run_docker_container, with the output going to the task's log."""
        import docker

        record = self._current or TaskRecord("task")
        first = record.log is None
        record.log = self.log_dir / f"{record.name}.log"
        self._show(record.name, status=RUNNING, log=record.log)
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            with record.log.open("w" if first else "a", encoding="utf-8") as log:
                log.write(f"ERROR: image {image} is not on the Docker daemon: build it with `make images`\n")
            record.returncode = 125  # docker run's own code for "the container could not be created"
            return record.returncode
        run_args.pop("auto_remove", None)
        container = client.containers.run(image=image, command=command, volumes=volumes, detach=True, **run_args)
        lines = Lines()
        try:
            with record.log.open("w" if first else "a", encoding="utf-8", buffering=1) as log:
                for chunk in container.logs(stream=True, follow=True):
                    for line in lines.feed(chunk):
                        self._line(record.name, line, log)
                for line in lines.close():
                    self._line(record.name, line, log)
            record.returncode = int(container.wait()["StatusCode"])
        finally:
            container.remove(force=True)
        return record.returncode

    def _line(self, name: str, line: str, log: Any) -> None:
        log.write(line + "\n")
        if self.echo:
            print(line)  # through kfp.local's indenting print, as its own streaming does
        progress = progress_of(line)
        if progress:
            self._show(name, progress=progress)

    def _cached_log(self, name: str, outputs: dict[str, Any] | None) -> Path:
        path = self.log_dir / f"{name}.log"
        lines = [f"{name}: not run; kfp.local's cache held its outputs from an earlier run:"]
        lines += [f"  {key}: {getattr(value, 'uri', value)}" for key, value in (outputs or {}).items()]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    def failed(self) -> TaskRecord | None:
        return next((r for r in self.records.values() if r.status == FAILED), None)


class Interrupted(BaseException):
    """SIGINT or SIGTERM to `kubealign run`: not an Exception, so that kfp.local's handlers let it through."""


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signum)


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class WriteOnlyCache:
    """kfp.local's cache as a run without --cache uses it: every finished task recorded, none reused, so that
    a later `kubealign run --cache` reuses what this run finished."""

    def __init__(self, cache: Any):
        self.cache = cache

    def compute_key(self, *args: Any, **kwargs: Any) -> str:
        return self.cache.compute_key(*args, **kwargs)

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, outputs: Any) -> None:
        self.cache.put(key, outputs)


@contextlib.contextmanager
def capture(log_dir: Path, display: Display | None, echo: bool, reuse: bool = True) -> Iterator[Capture]:
    """Route kfp.local's task lifecycle and task output through a Capture for the block. reuse False:
    kfp.local's cache (enabled) records the tasks that finish but returns no earlier outputs."""
    from kfp.local import cache as cache_module
    from kfp.local import docker_task_handler, subprocess_task_handler
    from kfp.local.orchestrator import orchestrator_utils, task_executor

    log_dir.mkdir(parents=True, exist_ok=True)
    cap = Capture(log_dir, display, echo)
    utils = orchestrator_utils.OrchestratorUtils
    original_execute = task_executor.execute_single_task
    original_run = subprocess_task_handler.run_local_subprocess
    original_docker = docker_task_handler.run_docker_container
    original_dag_artifacts = utils.__dict__["get_dag_output_artifacts"]
    original_arguments = utils.__dict__["make_task_arguments"]
    original_cache = cache_module.get_local_cache

    def execute_single_task(*args: Any, **kwargs: Any) -> Any:
        return cap.execute_single_task(original_execute, *args, **kwargs)

    task_executor.execute_single_task = execute_single_task
    subprocess_task_handler.run_local_subprocess = cap.run_local_subprocess
    docker_task_handler.run_docker_container = cap.run_docker_container
    utils.get_dag_output_artifacts = classmethod(dag_output_artifacts)

    def task_arguments(cls: Any, task_inputs_spec: Any, io_store: Any) -> dict[str, Any]:
        kept = without_failed_producers(task_inputs_spec, io_store)
        return original_arguments.__func__(cls, kept, io_store)

    utils.make_task_arguments = classmethod(task_arguments)
    if not reuse:

        def write_only() -> Any:
            found = original_cache()
            return None if found is None else WriteOnlyCache(found)

        cache_module.get_local_cache = write_only
    try:
        yield cap
    finally:
        task_executor.execute_single_task = original_execute
        subprocess_task_handler.run_local_subprocess = original_run
        docker_task_handler.run_docker_container = original_docker
        utils.get_dag_output_artifacts = original_dag_artifacts
        utils.make_task_arguments = original_arguments
        cache_module.get_local_cache = original_cache


def dag_output_artifacts(cls: Any, dag_outputs_spec: Any, io_store: Any) -> dict[str, Any]:
    """A DAG's output artifacts, each from the one selector whose producer ran (dsl.OneOf: one branch)."""
    outputs = {}
    for key, spec in dag_outputs_spec.artifacts.items():
        found = []
        for selector in spec.artifact_selectors:
            try:
                found.append(io_store.get_task_output(selector.producer_subtask, selector.output_artifact_key))
            except (KeyError, ValueError):  # that branch did not run
                continue
        if len(found) != 1:
            raise ValueError(f"DAG output {key!r}: {len(found)} of its branches produced it, expected exactly one")
        outputs[key] = found[0]
    return outputs


def without_failed_producers(task_inputs_spec: Any, io_store: Any) -> Any:
    """A copy of a task's TaskInputsSpec without the artifact inputs whose producer failed (or was skipped
    because its own upstream failed: kfp.local records both as FAILED). Only a task that runs although its
    upstream failed (ignore_upstream_failure) meets such an input; the compiler made it optional."""
    kept = type(task_inputs_spec)()
    kept.CopyFrom(task_inputs_spec)
    for name, spec in task_inputs_spec.artifacts.items():
        if not spec.HasField("task_output_artifact"):
            continue
        try:
            state = io_store.get_task_status(spec.task_output_artifact.producer_task)
        except ValueError:  # not ended (cannot happen after a topological order) or unknown: leave it
            continue
        if state == "FAILED":
            del kept.artifacts[name]
    return kept
