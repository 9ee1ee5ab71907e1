"""Stage compare: rank the candidates of one pipeline run (pipeline.candidates) by their evaluations, and
draw their reward-KL frontier.

Every candidate was evaluated against the same SFT baseline on the same prompts with the same sampling
seeds (one config, one evaluate.seed), so their evaluations compare directly. The rule, in order:

0. a candidate that a promotion guard (promote.guards: held-out capability, no degeneration) does not refuse
   and that keeps the KL budget (pipeline.max_kl) before any other (those: never the leader);
1. the gate's measure, higher first: `win_rate_lower_bound` (the 95 % bootstrap lower bound of the
   win-rate over the baseline) when promote.metric is win_rate, else promote.metric itself (e.g.
   fn/<NAME>/candidate, a reward function's mean);
2. then `candidate_reward_mean`, higher first;
3. then `kl_to_baseline`, lower first (the candidate that moved less from the SFT model for the same result);
4. then the order the candidates are listed in (a complete tie is settled by the order the user wrote).

Values are compared exactly: the win-rate bound moves in steps of 1/prompts, so real ties happen and fall
through to the next key. A candidate whose training or evaluation failed has no evaluation: it is listed
as failed and not ranked; with none left the stage fails with one line. With no candidate eligible,
the stage succeeds with no leader (`leader` null, `verdict` saying why in one line): nothing is promoted.

Outputs: result.json (the ranking, each candidate's settings and evaluation, the Pareto front, the
verdict), leaderboard.md (the KFP Markdown artifact), frontier.html (the KFP HTML artifact) and
frontier.png (kubealign.stages.compare_report draws them). In MLflow: a nested run as every stage; on the
pipeline's run the table (leaderboard.json), the picture (frontier.png) and one metric per candidate
(leaderboard/<name>: the ranking measure); and one nested run per candidate with its route and settings as
params and its figures as metrics, so MLflow's own compare view lines the candidates up.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.config.candidates import Candidate
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.promotion import guards
from kubealign.selection.frontier import pareto_front
from kubealign.selection.ranking import KL, Standing, measure_of, rank, within
from kubealign.stages import compare_report as report
from kubealign.tracking.runs import PARENT_RUN_ENV, stage_run

STAGE = "compare"


def run(
    config: KubealignConfig,
    candidates: Sequence[Candidate],
    evaluations: Mapping[str, Path | None],
    output: Path,
) -> dict[str, Any]:
    """Rank the candidates whose evaluation exists (the others failed); write OUTPUT; returns its result."""
    started = time.perf_counter()
    check_output_path(output, STAGE)
    names = [c.name for c in candidates]
    finished, metrics = {}, {}
    for name in names:
        directory = evaluations.get(name)
        if directory is None:
            continue
        result = read_result(directory)
        if result.get("stage") != "evaluate":
            raise UserError(f"compare: {directory}: result.json is from stage {result.get('stage')!r}, not evaluate")
        finished[name], metrics[name] = directory, result["metrics"]
    failed = [name for name in names if name not in finished]
    if not finished:
        raise UserError(f"compare: no candidate left: every route failed ({', '.join(names)}); see their logs")
    max_kl = config.pipeline.max_kl
    refused = {}  # the candidates a promotion guard refuses never lead: the gate would refuse them anyway
    for name, figures in metrics.items():
        found = guards.checks(figures, config.promote.guards, config.promote.min_win_rate, config.promote.tie_credit)
        failed_guard = next((c.text for c in found if c.ok is False), None)
        if failed_guard is not None:
            refused[name] = failed_guard
    standings = rank(metrics, config.promote.metric, names, max_kl, refused)
    eligible = within(standings[0].kl, max_kl) and standings[0].candidate not in refused
    leader = standings[0].candidate if eligible else None
    verdict = f"leader: {leader}" if leader else no_leader(standings, max_kl, refused)
    front = pareto_front({s.candidate: (s.kl, s.reward) for s in standings})
    by_name = {c.name: c for c in candidates}
    records = report.rows(standings, metrics, by_name, front)
    summary = {f"rank/{s.candidate}": float(s.rank) for s in standings}
    summary.update({f"leaderboard/{s.candidate}": s.measure for s in standings})
    summary["routes_failed"] = float(len(failed))
    summary["over_kl_budget"] = float(sum(not within(s.kl, max_kl) for s in standings))
    summary["refused_by_guards"] = float(len(refused))
    details = {
        "leader": leader,
        "verdict": verdict,
        "max_kl": max_kl,
        "refused": refused,
        "measure": measure_of(config.promote.metric),
        "routes": names,
        "candidates": [c.as_dict() for c in candidates],
        "failed": failed,
        "front": front,
        "standings": [s._asdict() for s in standings],
        "evaluations": {name: str(path) for name, path in finished.items()},
        "evaluation_metrics": metrics,
    }
    table = report.markdown(records, failed, details["measure"], leader)
    baseline = sum(m.get("baseline_reward_mean", 0.0) for m in metrics.values()) / len(metrics)
    png = report.plot(records, leader, baseline, max_kl)
    with stage_run(STAGE, config, output.resolve().parent) as tracker:
        summary["wall_time_s"] = time.perf_counter() - started
        tracker.log_metrics(summary)
        with atomic_dir(output) as tmp:
            (tmp / "leaderboard.md").write_text(table, encoding="utf-8")
            (tmp / "frontier.png").write_bytes(png)
            (tmp / "frontier.html").write_text(report.page(table, png, failed, verdict), encoding="utf-8")
            payload = write_result(tmp, STAGE, summary, {}, **details)
        log_to_pipeline_run(tracker, records, by_name, metrics, output / "frontier.png")
    return {**payload, "output": str(output)}


def no_leader(standings: Sequence[Standing], max_kl: float | None, refused: Mapping[str, str]) -> str:
    """The one line a run says when no candidate is eligible: each refused by a guard or over the KL budget."""
    over = [s for s in standings if s.candidate not in refused]
    if not over:
        first = standings[0].candidate
        return f"no leader: a promotion guard refuses every candidate ({first}: {refused[first]}); nothing is promoted"
    closest = min(over, key=lambda s: s.kl)
    return (
        f"no leader: no candidate within pipeline.max_kl {max_kl:g} (the closest, {closest.candidate}, has "
        f"{KL} {closest.kl:.4g}){'; the others are refused by a guard' if refused else ''}; nothing is promoted"
    )


def log_to_pipeline_run(
    tracker: Any,
    records: Sequence[dict[str, Any]],
    candidates: Mapping[str, Candidate],
    metrics: Mapping[str, Mapping[str, float]],
    picture: Path,
) -> None:
    """On the pipeline's run: the table, the picture and one metric per candidate; under it, a run per
    candidate. The pipeline's run is the parent of this stage's run (kubealign run, KUBEALIGN_PARENT_RUN_ID)
    or, on a cluster whose MLflow plugin injects MLFLOW_RUN_ID, that run itself (this stage logs into it)."""
    client = getattr(tracker, "_client", None)
    if client is None:  # tracking off, or not rank 0
        return
    from mlflow.entities import Metric, Param

    run_id = os.environ.get(PARENT_RUN_ENV) or tracker.run_id
    client.log_table(run_id, {k: [r[k] for r in records] for k in records[0]}, "leaderboard.json")
    client.log_artifact(run_id, str(picture))
    now = int(time.time() * 1000)
    measures = [Metric(f"leaderboard/{r['candidate']}", r["measure"], now, 0) for r in records]
    client.log_batch(run_id, metrics=measures)
    experiment_id = client.get_run(run_id).info.experiment_id
    for name, candidate in candidates.items():
        tags = {"mlflow.parentRunId": run_id, "kubealign.stage": "candidate", "kubealign.candidate": name}
        child = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        params = {"algorithm": candidate.route, **{key: str(value) for key, value in candidate.settings.items()}}
        figures: dict[str, float] = {}
        ranked = next((r for r in records if r["candidate"] == name), None)
        if ranked is not None:
            figures = {k: float(ranked[k]) for k in ("rank", "measure", "candidate_reward_mean", "kl_to_baseline")}
            figures.update({k: float(v) for k, v in metrics[name].items() if isinstance(v, int | float)})
            figures["on_front"] = float(ranked["on_front"])
        client.log_batch(  # one request per candidate: a run on a remote server is not a hot loop of calls
            child,
            metrics=[Metric(k, v, now, 0) for k, v in figures.items() if math.isfinite(v)],
            params=[Param(k, v) for k, v in params.items()],
        )
        client.set_terminated(child, "FINISHED" if ranked is not None else "FAILED")
