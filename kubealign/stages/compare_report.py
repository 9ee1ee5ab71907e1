"""What the compare stage shows a person: the leaderboard (Markdown for the KFP UI) and the frontier page
(HTML with the picture inlined, the KFP UI shows one file) and picture (PNG, for MLflow and docs/stages.md):
each candidate's reward against its KL to the SFT model, the Pareto front drawn and labelled, the leader
marked, the KL budget drawn; beside it the win-rates with their intervals."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kubealign.config.candidates import Candidate
from kubealign.selection.ranking import KL, REWARD, Standing

COLOURS = {"ppo": "#1f77b4", "grpo": "#2ca02c", "rloo": "#9467bd", "dpo": "#d62728"}


def settings_text(candidate: Candidate) -> str:
    return ", ".join(f"{key}={value}" for key, value in candidate.settings.items()) or "(its section's)"


def rows(
    standings: Sequence[Standing],
    metrics: Mapping[str, Mapping[str, float]],
    candidates: Mapping[str, Candidate],
    front: Sequence[str],
) -> list[dict[str, Any]]:
    """The leaderboard as records: one per ranked candidate."""
    return [
        {
            "rank": s.rank,
            "candidate": s.candidate,
            "route": candidates[s.candidate].route,
            "settings": settings_text(candidates[s.candidate]),
            "measure": s.measure,
            "win_rate": metrics[s.candidate].get("win_rate", math.nan),
            "win_rate_lower_bound": metrics[s.candidate].get("win_rate_lower_bound", math.nan),
            "win_rate_upper_bound": metrics[s.candidate].get("win_rate_upper_bound", math.nan),
            "candidate_reward_mean": s.reward,
            "kl_to_baseline": s.kl,
            "on_front": s.candidate in front,
            "behind_the_leader": s.why,
        }
        for s in standings
    ]


def markdown(records: Sequence[dict[str, Any]], failed: Sequence[str], measure: str, leader: str | None) -> str:
    """The table a person reads in the KFP UI (Markdown artifact)."""
    lines = [
        f"# Leaderboard: {len(records)} candidate(s) ranked by {measure}, then {REWARD}, then lower {KL}",
        "",
        "| rank | candidate | route | settings | win-rate [95 % interval] | reward (candidate mean) | KL to SFT "
        "| frontier | behind the leader |",
        "|---:|---|---|---|---|---:|---:|---|---|",
    ]
    for r in records:
        interval = f"{r['win_rate']:.3f} [{r['win_rate_lower_bound']:.3f}, {r['win_rate_upper_bound']:.3f}]"
        place = "leader" if r["candidate"] == leader else r["behind_the_leader"]
        lines.append(
            f"| {r['rank']} | {r['candidate']} | {r['route']} | {r['settings']} | {interval} | "
            f"{r['candidate_reward_mean']:.4f} | {r['kl_to_baseline']:.4f} | {'on the front' if r['on_front'] else ''}"
            f" | {place} |"
        )
    lines += [f"| – | {name} | | | failed: not ranked (see its task's log) | | | | |" for name in failed]
    if measure != "win_rate_lower_bound":
        figures = ", ".join(f"{r['candidate']} {r['measure']:.4f}" for r in records)
        lines += ["", f"Ranking measure {measure}: {figures}"]
    return "\n".join(lines) + "\n"


def page(table: str, png: bytes, failed: Sequence[str], verdict: str) -> str:
    """One self-contained page: the verdict, the table and the picture inlined."""
    image = base64.b64encode(png).decode("ascii")
    note = f"<p>Failed, not ranked: {html.escape(', '.join(failed))}</p>" if failed else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kubealign: the reward-KL frontier</title></head>"
        f"<body><p><b>{html.escape(verdict)}</b></p><pre>{html.escape(table)}</pre>{note}"
        "<img alt='reward against KL to the SFT model with the Pareto front; win-rates with intervals' "
        f"src='data:image/png;base64,{image}'></body></html>\n"
    )


def plot(records: Sequence[dict[str, Any]], leader: str | None, baseline: float, max_kl: float | None) -> bytes:
    """PNG: left, each candidate's reward against its KL to the SFT model (labelled by rank; the SFT model's
    reward in the title), the Pareto front as a line, the leader starred, the KL budget dashed; right, the
    win-rates over the SFT model with their 95 % bootstrap intervals, one bar per rank and name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for route in dict.fromkeys(r["route"] for r in records):
        mine = [r for r in records if r["route"] == route and math.isfinite(r["kl_to_baseline"])]
        xs, ys = [r["kl_to_baseline"] for r in mine], [r["candidate_reward_mean"] for r in mine]
        left.scatter(xs, ys, s=55, color=COLOURS.get(route), label=route, zorder=3)
    # points are labelled by rank (close candidates' names would overprint); the right panel names each rank
    for r in records:
        if math.isfinite(r["kl_to_baseline"]):
            point = (r["kl_to_baseline"], r["candidate_reward_mean"])
            offset = (5, 4) if r["rank"] % 2 else (5, -11)
            left.annotate(str(r["rank"]), point, textcoords="offset points", xytext=offset, fontsize=9)
    front = sorted((r["kl_to_baseline"], r["candidate_reward_mean"]) for r in records if r["on_front"])
    if front:
        left.plot(*zip(*front, strict=True), color="black", linewidth=1.2, label="Pareto front (reward up, KL down)")
    top = next((r for r in records if r["candidate"] == leader and math.isfinite(r["kl_to_baseline"])), None)
    if top is not None:
        point = (top["kl_to_baseline"], top["candidate_reward_mean"])
        left.scatter(*point, marker="*", s=320, facecolors="none", edgecolors="gold", linewidths=2, label="leader")
    if max_kl is not None:
        left.axvline(max_kl, color="grey", linestyle="--", linewidth=1, label=f"pipeline.max_kl {max_kl:g}")
    left.set_xlim(left=0)
    left.set(xlabel="KL to the SFT model (nats)", ylabel="reward (mean over held-out prompts)")
    left.set_title(f"reward against KL (the SFT model: reward {baseline:.3g} at KL 0)", fontsize=10)
    left.legend(fontsize=7, loc="best")
    names = [f"{r['rank']}. {r['candidate']}" for r in records]
    rates = [r["win_rate"] for r in records]
    below = [max(r["win_rate"] - r["win_rate_lower_bound"], 0.0) for r in records]
    above = [max(r["win_rate_upper_bound"] - r["win_rate"], 0.0) for r in records]
    right.barh(names, rates, xerr=[below, above], capsize=4, color=[COLOURS.get(r["route"]) for r in records])
    right.axvline(0.5, color="grey", linestyle="--", linewidth=1)
    right.invert_yaxis()  # rank 1 on top
    right.set(xlim=(0, 1), xlabel="win-rate over SFT")
    right.set_title("win-rate, 95 % bootstrap interval", fontsize=10)
    right.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()
