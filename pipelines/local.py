"""`kubealign run`: the whole DAG on this machine through kfp.local's SubprocessRunner.

The same compiled DAG a cluster runs, executed task by task as subprocesses of this Python (no
containers, no pip installs: use_venv=False). Around it, this module does what the cluster's MLflow
integration would: one parent MLflow run for the pipeline run, handed to every task through the
environment (KUBEALIGN_PARENT_RUN_ID, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID), so each stage's run
nests under it. Environment variables set this way are not part of kfp.local's cache key, so a second
`kubealign run --cache` still reuses unchanged tasks.

What it prints: one line per task (pending, running with its progress, done in N s, cached, failed),
redrawn in place on a terminal, one line per state change otherwise (kubealign.pipelines.progress).
Each task's full output goes to OUTPUT/logs/<task>.log and kfp.local's own log lines to
OUTPUT/logs/kfp-local.log (kubealign.pipelines.capture); `verbose` streams all of it as kfp.local does
(and still writes the logs). A failed task ends the run with PipelineFailed naming the task, its log
and the log's last error line.

Every run records the tasks it finished in kfp.local's cache; only `caching` (--cache) reuses them. Ctrl-C
or SIGTERM stops every task and ends the run with RunInterrupted (kubealign.pipelines.interrupt).

When it ends, OUTPUT/run.json indexes the run: each stage's artifact directory, its content hash and the
task's wall time.
`kubealign summary OUTPUT` and `kubealign rerun STAGE --from OUTPUT` read it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from kubealign import shape
from kubealign.config import KubealignConfig, config_to_json
from kubealign.config.cache import cache_root
from kubealign.errors import UserError, first_line
from kubealign.outputs import read_json, tree_sha256, write_json
from kubealign.ranks import RENDEZVOUS_ENV
from kubealign.tracking.runs import PARENT_RUN_ENV, default_store
from kubealign.usercode import definitions

INDEX_FILE = "run.json"
LOGS_DIR = "logs"
KFP_LOG = "kfp-local.log"
CANDIDATE = "candidate"  # the DAG output holding the route's model (dag.Outputs)


def tasks_for(config: KubealignConfig) -> tuple[str, ...]:
    """The tasks a run of `config`'s DAG executes, in DAG order (kubealign.shape.tasks_for_routes)."""
    judge = config.promote.mode == "canary"
    names = config.candidate_names() if config.several() else (config.route(),)
    parallelism = config.pipeline.parallelism
    served = (config.rewards.uses_model, config.serve.enabled, judge, parallelism)
    return shape.tasks_for_routes(names, *served, act=config.canary.act, feedback=bool(config.feedback.project))


@contextlib.contextmanager
def scoped_environ(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the duration of the block."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parent_run(config: KubealignConfig, output: Path) -> tuple[Any, str, str, str]:
    """(client, tracking URI, experiment id, run id) of a new parent run for this pipeline run."""
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import resolve_experiment, resolve_uri

    uri = resolve_uri(config)  # refuses credentials in the URI: it is written into run.json
    artifact_location = None
    if not uri:
        uri, artifact_location = default_store(output)
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = resolve_experiment(client, config.tracking.experiment, artifact_location)
        run_name = f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}"
        tags = {"kubealign.stage": "pipeline", "kubealign.runner": "kfp.local", **config.feedback.round_tags}
        run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        client.log_text(run_id, config_to_json(config), "config/resolved.json")
    except Exception as exc:
        raise UserError(f"MLflow tracking at {uri}: {first_line(exc)}") from None
    return client, uri, experiment_id, run_id


def write_index(
    output: Path, stages: dict[str, Path], extra: dict[str, Any], times: dict[str, float] | None = None
) -> dict:
    """OUTPUT/run.json: stage -> {dir, sha256, wall_time_s}, plus where the run came from. wall_time_s: the
    task's wall time as the user waited for it (`times`; a cached task's is its lookup's)."""
    entries = {name: {"dir": str(path), "sha256": tree_sha256(path)} for name, path in stages.items()}
    for name, seconds in (times or {}).items():
        if name in entries:
            entries[name]["wall_time_s"] = round(seconds, 3)
    index = {"stages": entries, **extra}
    write_json(output / INDEX_FILE, index)
    return index


def read_index(run: Path) -> dict[str, Any]:
    return read_json(run, INDEX_FILE, "expected the --output of `kubealign run`")


@contextlib.contextmanager
def quiet_parent(logs: Path, verbose: bool) -> Iterator[None]:
    """Unless verbose: kfp.local's own log lines (task started/finished, its outputs, separators) go to
    logs/kfp-local.log instead of stdout, and MLflow's INFO lines of this process (creating the store's
    tables) are not shown — the display says what a person needs."""
    if verbose:
        yield
        return
    import mlflow  # noqa: F401 - first: importing it sets the level of its logger

    mlflow_logger = logging.getLogger("mlflow")
    level = mlflow_logger.level
    mlflow_logger.setLevel(logging.WARNING)
    try:
        with (logs / KFP_LOG).open("a", encoding="utf-8") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        mlflow_logger.setLevel(level)


def check_run_output(output: Path) -> None:
    """A run writes into OUTPUT beside what is there (a new run of the DAG reuses it: same store, same
    logs dir), so OUTPUT must be new, empty, or an earlier run's: never a directory of the user's own."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: exists and is not a directory")
    ours = any((output / name).exists() for name in (INDEX_FILE, "kfp", LOGS_DIR))
    if output.is_dir() and any(output.iterdir()) and not ours:
        raise UserError(
            f"--output {output}: exists, is not empty and is not an earlier `kubealign run` output "
            f"(no {INDEX_FILE}, kfp/ or {LOGS_DIR}/); choose a new or empty directory"
        )


def check_sources(config: KubealignConfig) -> None:
    """A local data file that is not there, said in one line before anything is written or started (the
    data-split task would say the same minutes later, after the run directory and the MLflow run exist)."""
    from kubealign.data.sources import BUILT_IN, FILE_KINDS

    for i, source in enumerate(config.data.sources):
        path = Path(source.path).expanduser()
        if source.path in BUILT_IN or path.exists():
            continue
        local_file = source.path.endswith(tuple(FILE_KINDS)) or source.path.startswith((".", "/", "~"))
        if local_file or source.path.count("/") > 1:  # else a hub dataset name, which data-split loads
            raise UserError(f"data.sources[{i}].path: no such file or directory: {source.path}")


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped the run: the message is the one line to print (exit 130)."""


RUNNERS = ("subprocess", "docker")


def run(
    config: KubealignConfig,
    output: Path,
    caching: bool = False,
    verbose: bool = False,
    stream: TextIO | None = None,
    runner: str = "subprocess",
) -> dict[str, Any]:
    """Run the DAG locally into OUTPUT; returns the run index (also written to OUTPUT/run.json).
    Progress goes to `stream` (default: stdout) unless verbose, which streams every task's output.
    runner: subprocess (tasks in this Python environment) or docker (each task in the CPU image through
    kfp.local's DockerRunner: kubealign.containers.runner)."""
    from kfp import local

    from kubealign.pipelines.capture import Interrupted, capture
    from kubealign.pipelines.dag import build
    from kubealign.pipelines.interrupt import interrupted_line, stopping_tasks
    from kubealign.pipelines.progress import SKIPPED, Display

    if not config.tracking.enabled:
        raise UserError("tracking.enabled is false: the pipeline ends by promoting into the MLflow registry")
    if runner not in RUNNERS:
        raise UserError(f"--runner {runner}: choose one of {', '.join(RUNNERS)}")
    output = output.resolve()
    check_run_output(output)
    check_sources(config)
    # docker: kfp.local mounts only the pipeline root into the containers, and the tasks need the MLflow
    # store beside it: the whole OUTPUT is the root there.
    pipeline_root = output / "kfp" if runner == "subprocess" else output
    pipeline_root.mkdir(parents=True, exist_ok=True)
    logs = output / LOGS_DIR
    logs.mkdir(exist_ok=True)
    route = tasks_for(config)
    display = None if verbose else Display(stream or sys.stdout, list(route))
    with quiet_parent(logs, verbose):
        client, uri, experiment_id, parent = parent_run(config, output)
    # A task is a job of its own: rendezvous settings of the process that runs `kubealign run` (torchrun,
    # or one whose in-process stage set them) must not reach the tasks, or they all bind its MASTER_PORT.
    env: dict[str, str | None] = dict.fromkeys(RENDEZVOUS_ENV)
    env.update({"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_ID": experiment_id, PARENT_RUN_ENV: parent})
    config, task_runner, task_cache = _task_runner(config, output, env, runner)
    local.init(
        runner=task_runner,
        pipeline_root=str(pipeline_root),
        raise_on_error=False,
        # always on: a run without --cache still records what it finished (capture's reuse=False reads
        # nothing back), so that the next `kubealign run --cache` reuses it
        enable_caching=True,
        cache_root=str(task_cache),
    )
    started = time.perf_counter()
    tasks = None
    try:
        with (
            scoped_environ(env),
            warnings.catch_warnings(),
            display or contextlib.nullcontext(),
            quiet_parent(logs, verbose),
            capture(logs, display, echo=verbose, reuse=caching) as tasks,
            stopping_tasks(tasks),
        ):
            # kfp.local warns that our image names do not say "python": here the image is this environment.
            warnings.filterwarnings("ignore", message=".*non-Python base image.*")
            # ... and that GPUs, requests, display names and secrets mean nothing without a cluster.
            warnings.filterwarnings("ignore", message=".*have no effect.*")
            # kfp.local honours a task's retry policy, backoff included: a task that failed here fails the same
            # way again (no preemption on this machine), so the retries would only add minutes. Not in any key.
            outputs = build(without_retries(config))().outputs
            for name in route:  # kfp.local skips, without a word, what depends on a failed task
                if display is not None and name not in tasks.records:
                    display.update(name, status=SKIPPED)
    except Interrupted:
        client.set_terminated(parent, "KILLED")
        raise RunInterrupted(interrupted_line(tasks)) from None
    wall = time.perf_counter() - started
    stages = _stage_dirs(config, route, tasks.records, outputs)
    mlflow = {"tracking_uri": uri, "experiment_id": experiment_id, "parent_run_id": parent}
    return _finish(
        config, output, route, stages, tasks, logs, {"wall_time_s": wall, "mlflow": mlflow, "runner": runner}, client
    )


def _finish(
    config: KubealignConfig,
    output: Path,
    route: tuple[str, ...],
    stages: dict[str, Path],
    tasks: Any,
    logs: Path,
    extra: dict[str, Any],
    client: Any,
) -> dict[str, Any]:
    """Write the run index, end the parent MLflow run; a failed task that fails the run raises PipelineFailed.
    With several candidates, one whose training or evaluation failed does not fail the run: the comparison
    ranks the others (a failed promotion still does: the registry is the run's point)."""
    several = config.several()
    names = config.candidate_names()
    failed_candidates = [r for r in names if not {r, f"evaluate-{r}"} <= set(stages)] if several else []
    # a wait task (pipeline.parallelism) has no output to index
    ok = all(s in stages for s in route if shape.route_of(s) not in failed_candidates and not shape.is_wait(s))
    extra = {
        "config_json": config_to_json(config),
        "reward_functions": definitions.to_json(definitions.resolve_all(config.rewards, config.tools, config.base_dir)),
        **extra,
        "succeeded": ok,
        "algorithm": config.route(),
    }
    if several:
        extra["algorithms"] = list(names)
        extra["candidates"] = [c.as_dict() for c in config.candidates()]
        records = tasks.records
        extra["failed_routes"] = {name: failure_message(failed_in(records, name), logs) for name in failed_candidates}
    times = {r.name: r.wall_time_s for r in tasks.records.values() if r.wall_time_s is not None}
    index = write_index(output, stages, extra, times)
    parent = extra["mlflow"]["parent_run_id"]
    client.log_metric(parent, "wall_time_s", extra["wall_time_s"])
    client.set_terminated(parent, "FINISHED" if ok else "FAILED")
    if not ok:  # name the task that failed the run, not a failed route's (the summary names those)
        failed = [r for r in tasks.records.values() if r.status == "failed"]
        culprits = [r for r in failed if shape.route_of(r.name) not in failed_candidates]
        raise PipelineFailed(failure_message(culprits[0] if culprits else tasks.failed(), logs))
    return index


def without_retries(config: KubealignConfig) -> KubealignConfig:
    """The config with kubernetes.retries 0: what a local run compiles (see run)."""
    return config.model_copy(update={"kubernetes": config.kubernetes.model_copy(update={"retries": 0})})


def _task_runner(
    config: KubealignConfig, output: Path, env: dict[str, str | None], runner: str
) -> tuple[KubealignConfig, Any, Path]:
    """(the config the tasks get, kfp.local's runner, its cache root). docker: each task in the CPU image
    (kubealign.containers.runner; env gains DOCKER_HOST, which kfp.local's handler reads)."""
    from kfp import local

    if runner == "docker":
        from kubealign.containers.runner import prepare

        config, task_runner, docker_host = prepare(config, output, env)
        env["DOCKER_HOST"] = docker_host  # kfp.local's handler connects with docker.from_env()
        # the containers see only OUTPUT: a cache entry pointing into another run's output is of no use
        return config, task_runner, output / "kfp-cache"
    # one cache for every run on this machine, like KFP's own: a run into another --output still
    # reuses tasks whose inputs are unchanged (entries whose artifacts were deleted are misses)
    return config, local.SubprocessRunner(use_venv=False), cache_root() / "kfp-local"


def _stage_dirs(
    config: KubealignConfig, route: tuple[str, ...], records: dict[str, Any], outputs: Any
) -> dict[str, Path]:
    """Each finished task's output directory. Cached tasks point into the run that computed them: take the
    directories from the outputs (of each task, with several routes: a failed route leaves kfp.local's
    pipeline outputs empty)."""
    several = config.several()
    stages = {}
    for stage in (s for s in route if not shape.is_wait(s)):
        # feedback, serve, judge and act are no pipeline outputs: their tasks' own
        if several or stage in (shape.FEEDBACK, shape.SERVE, shape.JUDGE, shape.ACT):
            artifact = records[stage].outputs.get(shape.output_key(stage)) if stage in records else None
        else:
            key = CANDIDATE if stage == shape.route_task(config.route()) else stage.replace("-", "_")
            artifact = outputs.get(key)
        if artifact is not None and (Path(artifact.path) / "result.json").is_file():
            stages[stage] = Path(artifact.path)
    return stages


def failed_in(records: dict[str, Any], candidate: str) -> Any:
    """The task of `candidate` (its name) that failed (its training or its evaluation), or None."""
    return next(
        (records[t] for t in (candidate, f"evaluate-{candidate}") if t in records and records[t].status == "failed"),
        None,
    )


def failure_message(failed: Any, logs: Path) -> str:
    """One line: which task failed, why (its log's last error line) and where its log is."""
    from kubealign.pipelines.progress import shown_path

    if failed is None:  # kfp.local failed outside any task (or a task ran nothing)
        return f"pipeline run failed; kfp.local's log: {shown_path(logs / KFP_LOG)}"
    where = f"log: {shown_path(failed.log)}" if failed.log else f"kfp.local's log: {shown_path(logs / KFP_LOG)}"
    return f"task {failed.name} failed: {failed.error_line()} ({where})"


class PipelineFailed(RuntimeError):
    """A task of the local run failed: the message names it, its log and the log's last error line."""
