"""`kubealign rerun STAGE --from RUN_DIR`: one stage (and optionally what follows it) again, on the
artifacts of an earlier `kubealign run`.

The earlier run's index (RUN_DIR/run.json) names each stage's directory and its content hash. The
rerun checks that the inputs it takes from there are unchanged (same hash), runs the stage through the
same kubealign.tasks function its KFP component calls, with the earlier run's config plus any --set,
and writes a new run directory whose index points at the reused upstream directories and the new
ones. Nothing of the earlier run is modified.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kubealign import shape, tasks
from kubealign.config import config_from_json, config_to_json
from kubealign.errors import UserError
from kubealign.outputs import tree_sha256
from kubealign.pipelines.local import parent_run, read_index, scoped_environ, write_index
from kubealign.shape import downstream_of, route_task, stages_for, upstream
from kubealign.tracking.runs import PARENT_RUN_ENV


def _run_stage(
    stage: str, config_json: str, dirs: dict[str, Path], out: Path, algorithm: str, functions: str
) -> dict[str, Any]:
    d = {name: str(path) for name, path in dirs.items()}
    scorer = d.get(shape.scorer("reward" in d), "")  # the reward model, else the SFT model (kubealign.shape)
    candidate = route_task(algorithm)
    if stage == "feedback":
        return tasks.feedback(config_json, str(out))
    if stage == "data-split":  # with the run's pulled choices, where it had a feedback task
        return tasks.data_split(config_json, [], str(out), d.get("feedback"))
    if stage in ("sft", "reward"):
        return tasks.train(stage, config_json, [], d["data-split"], "", str(out))
    if stage == "dpo":
        return tasks.train("dpo", config_json, [], d["data-split"], d["sft"], str(out))
    if stage == "ppo":
        # as the DAG's ppo task: the route sets ppo.algorithm (a grpo candidate runs GRPO whatever ppo.algorithm says)
        overrides = [f"ppo.algorithm={algorithm}"]
        return tasks.ppo(config_json, overrides, d["data-split"], d["sft"], scorer, str(out), functions)
    if stage == "evaluate":
        return tasks.evaluate(config_json, [], d["data-split"], d["sft"], d[candidate], scorer, str(out), functions)
    if stage == "serve":
        return tasks.serve(config_json, [], d["promote"], str(out))
    if stage == "judge":
        return tasks.judge(config_json, [], d["data-split"], d["sft"], scorer, d["serve"], str(out))
    if stage == "act":  # the judge's verdict carried out again: a rerun finishes one carried out halfway
        return tasks.act(config_json, [], d["judge"], str(out))
    return tasks.promote(config_json, [], d["evaluate"], d[candidate], str(out))


def reusable(index: dict[str, Any], run: Path, name: str, stage: str) -> Path:
    """The directory of RUN's `name` output, which `stage` needs, checked unchanged since the run."""
    entry = index["stages"].get(name)
    if entry is None:
        raise UserError(f"{run / 'run.json'}: the run has no {name} output, which {stage} needs")
    path = Path(entry["dir"])
    if not path.is_dir() or tree_sha256(path) != entry["sha256"]:
        raise UserError(f"{path}: the {name} output changed or vanished since the run; cannot reuse it")
    return path


def kept_times(index: dict[str, Any], reused: list[str]) -> dict[str, float]:
    """The reused stages' wall times as the earlier run measured them: their run.json entries carry over."""
    entries = index["stages"]
    return {name: entries[name]["wall_time_s"] for name in reused if "wall_time_s" in entries.get(name, {})}


def start(
    config: Any, index: dict[str, Any], run: Path, stage: str, output: Path | None
) -> tuple[Path, Any, str, dict[str, str]]:
    """The rerun's output directory (new or empty) and its parent MLflow run, tagged as a rerun of RUN's:
    (output, client, parent run id, the environment that nests the stages under it)."""
    output = (output or run.parent / f"{run.name}-rerun-{stage}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {output}: exists and is not empty")
    client, uri, experiment_id, parent = parent_run(config, output)
    client.set_tag(parent, "kubealign.rerun_of", index.get("mlflow", {}).get("parent_run_id", str(run)))
    return (
        output,
        client,
        parent,
        {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_ID": experiment_id, PARENT_RUN_ENV: parent},
    )


def rerun(
    stage: str, run: Path, overrides: list[str], downstream: bool = False, output: Path | None = None
) -> dict[str, Any]:
    """Rerun `stage` (plus its downstream stages) from RUN's artifacts into OUTPUT; returns the new index."""
    index = read_index(run)
    if "config_json" not in index:
        raise UserError(f"{run / 'run.json'}: no config_json; was it written by `kubealign run`?")
    config = config_from_json(index["config_json"], overrides)
    if config.several():
        return rerun_route(stage, run, index, config, output)
    if config.pipeline.candidates:  # one candidate: a one-route run with its settings (as the DAG compiles it)
        config = config.for_candidate(config.candidates()[0])
    if stage in ("grpo", "rloo") and stage == config.route():  # the route's name for its (ppo) task
        stage = "ppo"
    canary = config.promote.mode == "canary"
    feedback = bool(config.feedback.project)
    route = stages_for(
        config.route(), config.rewards.uses_model, config.serve.enabled, canary, config.canary.act, feedback
    )
    if stage not in route:
        raise UserError(f"rerun: {stage!r} is not a stage of this run ({config.route()}: {', '.join(route)})")
    todo = [stage, *downstream_of(stage, route)] if downstream else [stage]
    names = {up for s in todo for up in upstream(s, route)} - set(todo)
    dirs = {name: reusable(index, run, name, stage) for name in names}
    output, client, parent, env = start(config, index, run, stage, output)
    uri, experiment_id = env["MLFLOW_TRACKING_URI"], env["MLFLOW_EXPERIMENT_ID"]
    config_json = config_to_json(config)
    # the functions' code as the run used it (run.json), not as the files read now: a rerun repeats the run
    functions = index.get("reward_functions", "")
    status = "FAILED"
    times = {}
    try:
        with scoped_environ(env):
            for name in todo:
                started = time.perf_counter()
                _run_stage(name, config_json, dirs, output / name, config.route(), functions)
                dirs[name], times[name] = output / name, time.perf_counter() - started
        status = "FINISHED"
    finally:
        client.set_terminated(parent, status)
    reused = sorted(set(dirs) - set(todo))
    extra = {"config_json": config_json, "rerun_of": str(run), "rerun": todo, "reused": reused}
    extra["reward_functions"] = functions
    extra["mlflow"] = {"tracking_uri": uri, "experiment_id": experiment_id, "parent_run_id": parent}
    return write_index(output, dirs, extra, {**kept_times(index, reused), **times})


def rerun_route(candidate: str, run: Path, index: dict[str, Any], config: Any, output: Path | None) -> dict[str, Any]:
    """A several-candidate run: `candidate` (its name) trained and evaluated again, then the comparison and
    every ranked candidate's promotion (ranks may change), on the shared tasks' and the other candidates'
    outputs of RUN. `candidate` "compare" reruns only the comparison and the promotions."""
    from kubealign.pipelines.local import tasks_for

    candidates = {c.name: c for c in config.candidates()}
    names = tuple(candidates)
    if candidate not in (*names, "compare"):
        raise UserError(
            f"rerun: {candidate!r} is not a candidate of this run; a run comparing {', '.join(names)} reruns one of "
            "them or compare (the shared stages: `kubealign run --cache` with the change)"
        )
    retrained = [candidate, f"evaluate-{candidate}"] if candidate != "compare" else []
    needed = [t for t in tasks_for(config) if t in ("data-split", "sft", "reward") or t.startswith("evaluate-")]
    needed += [r for r in names if r != candidate]
    # a candidate that failed in RUN has no outputs there and stays failed; a shared stage must be there
    kept = [t for t in needed if t not in retrained and (t in index["stages"] or t in ("data-split", "sft", "reward"))]
    dirs = {name: reusable(index, run, name, candidate) for name in kept}
    output, client, parent, env = start(config, index, run, candidate, output)
    uri, experiment_id = env["MLFLOW_TRACKING_URI"], env["MLFLOW_EXPERIMENT_ID"]
    config_json = config_to_json(config)
    functions = index.get("reward_functions", "")
    todo = list(retrained)
    status = "FAILED"
    try:
        with scoped_environ(env):
            if candidate != "compare":
                ours = candidates[candidate]  # trained with its settings, evaluated with the run's shared config
                trained_json = config_to_json(config.for_candidate(ours))
                _run_stage(route_task(ours.route), trained_json, dirs, output / candidate, ours.route, functions)
                dirs[candidate] = output / candidate
                _run_stage(
                    "evaluate",
                    config_json,
                    {**dirs, route_task(ours.route): dirs[candidate]},
                    output / f"evaluate-{candidate}",
                    ours.route,
                    functions,
                )
                dirs[f"evaluate-{candidate}"] = output / f"evaluate-{candidate}"
            evaluations = {r: str(dirs[f"evaluate-{r}"]) if f"evaluate-{r}" in dirs else None for r in names}
            listed = [c.as_dict() for c in candidates.values()]
            tasks.compare(config_json, [], listed, evaluations, str(output / "compare"))
            dirs["compare"] = output / "compare"
            todo.append("compare")
            for name in (r for r in names if f"evaluate-{r}" in dirs and r in dirs):
                target = output / f"promote-{name}"
                tasks.promote(
                    config_json,
                    [],
                    str(dirs[f"evaluate-{name}"]),
                    str(dirs[name]),
                    str(target),
                    str(output / "compare"),
                    name,
                )
                dirs[f"promote-{name}"] = target
                todo.append(f"promote-{name}")
        status = "FINISHED"
    finally:
        client.set_terminated(parent, status)
    reused = sorted(set(dirs) - set(todo))
    extra = {"config_json": config_json, "rerun_of": str(run), "rerun": todo, "reused": reused}
    extra.update({"reward_functions": functions, "algorithm": config.route(), "algorithms": list(names)})
    extra["failed_routes"] = {r: "failed in the earlier run (not rerun)" for r in names if r not in dirs}
    extra["mlflow"] = {"tracking_uri": uri, "experiment_id": experiment_id, "parent_run_id": parent}
    return write_index(output, dirs, extra, kept_times(index, reused))
