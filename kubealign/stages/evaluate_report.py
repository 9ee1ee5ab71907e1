"""The evaluate stage's report: eval_samples.json's rows (each prompt with both models' decoded answers and
their scores), the samples page (samples.html, samples.md: the first rows, headed by the guard figures of both
models, with each row's LLM-judge verdict when one judged), the reward distribution plot and, when the
candidate's result.json has a PPO history, its training curves (ppo_curves.png).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

GUARD_FIGURES = (  # what the promotion guards read, as the samples page shows it beside the answers
    ("heldout_logprob", "held-out log-likelihood per token"),
    ("heldout_reward_mean", "held-out reward model's mean score"),
    ("repetition_rate", "repeated-bigram rate"),
    ("distinct_2", "distinct-2"),
    ("empty_rate", "empty answers"),
    ("unfinished_rate", "unfinished answers"),
    ("length_mean", "mean length (tokens)"),
)


def sample_table(tokenizer: Any, texts: list[str], base: list[dict], cand: list[dict]) -> list[dict[str, Any]]:
    """eval_samples.json's rows: each prompt with both models' decoded answers and their scores."""
    decode = lambda r: tokenizer.decode(r["tokens"], skip_special_tokens=True)  # noqa: E731
    return [
        {
            "prompt": p,
            "baseline": decode(b),
            "candidate": decode(c),
            "baseline_score": b["score"],
            "candidate_score": c["score"],
            **({"baseline_fn": b["fn"], "candidate_fn": c["fn"]} if b["fn"] else {}),
            **(
                {"baseline_heldout_score": b["heldout_score"], "candidate_heldout_score": c["heldout_score"]}
                if "heldout_score" in b
                else {}
            ),
        }
        for p, b, c in zip(texts, base, cand, strict=True)
    ]


def sample_tables(table: list[dict[str, Any]], metrics: dict[str, float] | None = None) -> tuple[str, str]:
    """(HTML page, Markdown) of the sample table, headed by the guards' figures of both models (`metrics`:
    evaluate's; a figure it lacks is left out); with an "llm judge" column of each row's verdict when the LLM
    judge judged ("no verdict" for a row it gave none), none without one."""
    head = ["prompt", "baseline", "candidate", "baseline score", "candidate score"]
    cells = [
        [r["prompt"], r["baseline"], r["candidate"], f"{r['baseline_score']:.3f}", f"{r['candidate_score']:.3f}"]
        for r in table
    ]
    if any("llm_judge" in r for r in table):
        head.append("llm judge")
        for row, r in zip(cells, table, strict=True):
            row.append(r.get("llm_judge") or "no verdict")
    m = metrics or {}
    figures = [
        [said, f"{m[f'baseline_{name}']:.3f}", f"{m[f'candidate_{name}']:.3f}"]
        for name, said in GUARD_FIGURES
        if f"baseline_{name}" in m and f"candidate_{name}" in m
    ]
    figure_head = ["guard figure", "baseline", "candidate"]

    def rows_html(rows: list[list[str]]) -> str:
        return "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)

    def head_html(names: list[str]) -> str:
        return "<tr>" + "".join(f"<th>{h}</th>" for h in names) + "</tr>\n"

    guards_html = (
        f"<h2>Guard figures</h2><table>\n{head_html(figure_head)}{rows_html(figures)}</table>" if figures else ""
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kubealign evaluation samples</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:4px;vertical-align:top;white-space:pre-wrap}</style></head><body>"
        f"<h1>Evaluation samples</h1>{guards_html}<table>\n{head_html(head)}{rows_html(cells)}</table></body></html>\n"
    )

    def md(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    def md_table(names: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(names) + " |",
            "|" + "---|" * len(names),
            *("| " + " | ".join(md(c) for c in r) + " |" for r in rows),
        ]

    lines = [*md_table(figure_head, figures), ""] if figures else []
    return page, "\n".join([*lines, *md_table(head, cells)]) + "\n"


def plots(directory: Path, base: list[dict], cand: list[dict], history: list[dict] | None) -> list[str]:
    """PNG plots: reward distributions, and the PPO training curves when a history is available."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([r["score"] for r in base], bins=20, alpha=0.6, label="baseline (SFT)")
    ax.hist([r["score"] for r in cand], bins=20, alpha=0.6, label="candidate")
    ax.set(xlabel="score (reward model and / or reward functions)", ylabel="responses", title="Reward distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "reward_distribution.png", dpi=100)
    plt.close(fig)
    made = ["reward_distribution.png"]
    if history:
        fig, axes = plt.subplots(2, 2, figsize=(9, 6))
        steps = [h["iteration"] for h in history]
        # the fourth panel: the critic's loss for PPO; GRPO and RLOO have no critic but a group spread
        fourth = "value_loss" if "value_loss" in history[0] else "group_reward_std"
        for ax, key in zip(axes.flat, ("reward_mean", "kl", "policy_loss", fourth), strict=True):
            ax.plot(steps, [h.get(key, float("nan")) for h in history])
            ax.set(title=key, xlabel="iteration")
        fig.tight_layout()
        fig.savefig(directory / "ppo_curves.png", dpi=100)
        plt.close(fig)
        made.append("ppo_curves.png")
    return made


def read_history(candidate: Path) -> list[dict] | None:
    """The candidate's training history from its result.json, when a PPO run wrote it (None otherwise)."""
    try:
        result = json.loads((Path(candidate) / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return result.get("history") if result.get("stage") == "ppo" else None  # only a PPO run has these curves
