"""Stage compare: rank the routes of one pipeline run (pipeline.algorithms) by their evaluations.

Every route's candidate was evaluated against the same SFT baseline on the same prompts with the same
sampling seeds (one config, one evaluate.seed), so their evaluations compare directly. The rule, in order:

1. the gate's measure, higher first: `win_rate_lower_bound` (the 95 % bootstrap lower bound of the
   win-rate over the baseline) when promote.metric is win_rate, else promote.metric itself (e.g.
   fn/<NAME>/candidate, a reward function's mean);
2. then `candidate_reward_mean`, higher first;
3. then `kl_to_baseline`, lower first (the candidate that moved less from the SFT model for the same result);
4. then the order of pipeline.algorithms (a complete tie is settled by the order the user wrote).

Values are compared exactly: the win-rate bound moves in steps of 1/prompts, so real ties happen and fall
through to the next key. A route whose training or evaluation failed has no evaluation: it is listed as
failed and not ranked; with none left the stage fails with one line.

Outputs: result.json (the ranking, each route's evaluation and why it is not first), leaderboard.md
(the KFP Markdown artifact) and leaderboard.html (the table and a plot of reward against KL and of the
win-rates with their intervals). In MLflow: a nested run as every stage, and on the pipeline's run the
table (leaderboard.json) and one metric per route (leaderboard/<route>: the ranking measure).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.ranking import KL, REWARD, Standing, measure_of, rank
from kubealign.tracking import PARENT_RUN_ENV, stage_run

STAGE = "compare"


def run(
    config: KubealignConfig, routes: Sequence[str], evaluations: Mapping[str, Path | None], output: Path
) -> dict[str, Any]:
    """Rank the routes whose evaluation exists (the others failed); write OUTPUT; returns its result."""
    started = time.perf_counter()
    check_output_path(output, STAGE)
    finished, metrics = {}, {}
    for route in routes:
        directory = evaluations.get(route)
        if directory is None:
            continue
        result = read_result(directory)
        if result.get("stage") != "evaluate":
            raise UserError(f"compare: {directory}: result.json is from stage {result.get('stage')!r}, not evaluate")
        finished[route], metrics[route] = directory, result["metrics"]
    failed = [route for route in routes if route not in finished]
    if not finished:
        raise UserError(f"compare: no candidate left: every route failed ({', '.join(routes)}); see their logs")
    standings = rank(metrics, config.promote.metric, list(routes))
    leader = standings[0].route
    summary = {f"rank/{s.route}": float(s.rank) for s in standings}
    summary.update({f"leaderboard/{s.route}": s.measure for s in standings})
    summary["routes_failed"] = float(len(failed))
    details = {
        "leader": leader,
        "measure": measure_of(config.promote.metric),
        "routes": list(routes),
        "failed": failed,
        "standings": [s._asdict() for s in standings],
        "evaluations": {route: str(path) for route, path in finished.items()},
        "evaluation_metrics": metrics,
    }
    table = leaderboard_markdown(standings, metrics, failed, details["measure"])
    with stage_run(STAGE, config, output.resolve().parent) as tracker:
        summary["wall_time_s"] = time.perf_counter() - started
        tracker.log_metrics(summary)
        log_to_pipeline_run(tracker, standings, metrics)
        with atomic_dir(output) as tmp:
            (tmp / "leaderboard.md").write_text(table, encoding="utf-8")
            (tmp / "leaderboard.html").write_text(leaderboard_html(table, standings, metrics, failed), encoding="utf-8")
            payload = write_result(tmp, STAGE, summary, {}, **details)
    return {**payload, "output": str(output)}


def rows(standings: Sequence[Standing], metrics: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """The leaderboard as records: one per ranked route."""
    return [
        {
            "rank": s.rank,
            "route": s.route,
            "measure": s.measure,
            "win_rate": metrics[s.route].get("win_rate", math.nan),
            "win_rate_lower_bound": metrics[s.route].get("win_rate_lower_bound", math.nan),
            "win_rate_upper_bound": metrics[s.route].get("win_rate_upper_bound", math.nan),
            "candidate_reward_mean": s.reward,
            "kl_to_baseline": s.kl,
            "behind_the_leader": s.why,
        }
        for s in standings
    ]


def log_to_pipeline_run(
    tracker: Any, standings: Sequence[Standing], metrics: Mapping[str, Mapping[str, float]]
) -> None:
    """The table and one metric per route on the pipeline's run: the parent of this stage's run
    (kubealign run, KUBEALIGN_PARENT_RUN_ID) or, on a cluster whose MLflow plugin injects MLFLOW_RUN_ID,
    that run itself (this stage logs into it)."""
    client = getattr(tracker, "_client", None)
    if client is None:  # tracking off, or not rank 0
        return
    run_id = os.environ.get(PARENT_RUN_ENV) or tracker.run_id
    records = rows(standings, metrics)
    client.log_table(run_id, {k: [r[k] for r in records] for k in records[0]}, "leaderboard.json")
    for s in standings:
        client.log_metric(run_id, f"leaderboard/{s.route}", s.measure)


def leaderboard_markdown(
    standings: Sequence[Standing], metrics: Mapping[str, Mapping[str, float]], failed: Sequence[str], measure: str
) -> str:
    """The table a person reads in the KFP UI (Markdown artifact)."""
    lines = [
        f"# Leaderboard: {len(standings)} route(s) ranked by {measure}, then {REWARD}, then lower {KL}",
        "",
        "| rank | route | win-rate [95 % interval] | reward (candidate mean) | KL to SFT | behind the leader |",
        "|---:|---|---|---:|---:|---|",
    ]
    for r in rows(standings, metrics):
        interval = f"{r['win_rate']:.3f} [{r['win_rate_lower_bound']:.3f}, {r['win_rate_upper_bound']:.3f}]"
        lines.append(
            f"| {r['rank']} | {r['route']} | {interval} | {r['candidate_reward_mean']:.4f} | "
            f"{r['kl_to_baseline']:.4f} | {r['behind_the_leader'] or 'leader'} |"
        )
    lines += [f"| – | {route} | failed: not ranked (see its task's log) | | | |" for route in failed]
    if measure != "win_rate_lower_bound":
        lines += ["", f"Ranking measure {measure}: " + ", ".join(f"{s.route} {s.measure:.4f}" for s in standings)]
    return "\n".join(lines) + "\n"


def leaderboard_html(
    table: str, standings: Sequence[Standing], metrics: Mapping[str, Mapping[str, float]], failed: Sequence[str]
) -> str:
    """One self-contained page (the KFP UI shows one file): the table and the plot inlined as a PNG."""
    image = base64.b64encode(plot(standings, metrics)).decode("ascii")
    body = html.escape(table)
    note = f"<p>Failed, not ranked: {html.escape(', '.join(failed))}</p>" if failed else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kubealign leaderboard</title></head><body>"
        f"<pre>{body}</pre>{note}<img alt='reward against KL; win-rates with intervals' "
        f"src='data:image/png;base64,{image}'></body></html>\n"
    )


def plot(standings: Sequence[Standing], metrics: Mapping[str, Mapping[str, float]]) -> bytes:
    """PNG: each route's candidate reward against its KL to the SFT model, and its win-rate with the
    bootstrap interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = rows(standings, metrics)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in records:
        kl = r["kl_to_baseline"] if math.isfinite(r["kl_to_baseline"]) else 0.0
        left.scatter([kl], [r["candidate_reward_mean"]], s=60)
        left.annotate(
            f"{r['rank']}. {r['route']}", (kl, r["candidate_reward_mean"]), textcoords="offset points", xytext=(6, 4)
        )
    left.set(xlabel="KL to the SFT model (nats)", ylabel="candidate reward (mean)", title="reward against KL")
    names = [r["route"] for r in records]
    rates = [r["win_rate"] for r in records]
    below = [max(r["win_rate"] - r["win_rate_lower_bound"], 0.0) for r in records]
    above = [max(r["win_rate_upper_bound"] - r["win_rate"], 0.0) for r in records]
    right.bar(names, rates, yerr=[below, above], capsize=6, color="#7a9cc6")
    right.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    right.set(ylim=(0, 1), ylabel="win-rate over SFT", title="win-rate, 95 % bootstrap interval")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()
