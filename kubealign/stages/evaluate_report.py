"""The evaluate stage's report: eval_samples.json's rows (each prompt with both models' decoded answers and
their scores), the samples page (samples.html, samples.md: the headline figures and a verdict on the win-rate,
the guard figures of both models, then the first rows, with each row's LLM-judge verdict when one judged), the
reward distribution plot and, when the candidate's result.json has a PPO history, its training curves
(ppo_curves.png).
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
TITLE = "Evaluation report: the candidate against the SFT baseline"
ABOUT = (
    "The evaluate stage's answers of the candidate policy and of the SFT baseline to the same held-out prompts, "
    "scored by the reward the candidate was trained with; the promote stage's gate decides from these figures."
)


def headline(m: dict[str, float]) -> list[list[str]]:
    """The figures a reader looks for first, those `m` (evaluate's metrics) has: [[what, value], ...]."""
    rows = []
    if "win_rate" in m:
        bound = f" (95 % lower bound {m['win_rate_lower_bound']:.2f})" if "win_rate_lower_bound" in m else ""
        ties = f", ties {m['tie_rate']:.2f}" if "tie_rate" in m else ""
        rows.append(["win-rate over SFT", f"{m['win_rate']:.2f}{bound}{ties}"])
    if "baseline_reward_mean" in m and "candidate_reward_mean" in m:
        rows.append(
            ["reward, SFT vs candidate", f"{m['baseline_reward_mean']:.3f} vs {m['candidate_reward_mean']:.3f}"]
        )
    if "kl_to_baseline" in m:
        rows.append(["KL to SFT (nats per answer)", f"{m['kl_to_baseline']:.3f}"])
    for name, said in (("preferred_rate", "preferred answers"), ("well_formed_rate", "well-formed answers")):
        if f"baseline_{name}" in m and f"candidate_{name}" in m:
            rows.append([said, f"{m[f'baseline_{name}']:.0%} (SFT) -> {m[f'candidate_{name}']:.0%} (candidate)"])
    if "heldout_win_rate" in m:
        rows.append(["held-out reward model's win-rate", f"{m['heldout_win_rate']:.2f}"])
    return rows


def verdict(m: dict[str, float]) -> str:
    """What the win-rate says, on its 95 % lower bound when evaluate measured one; "" without a win-rate."""
    if "win_rate" not in m:
        return ""
    rate, bound = m["win_rate"], m.get("win_rate_lower_bound")
    if rate < 0.5:
        return f"verdict: the SFT baseline is preferred (win-rate {rate:.2f}, below 0.5)"
    if bound is None:
        return f"verdict: the candidate is preferred (win-rate {rate:.2f}; no 95 % bound measured)"
    said = f"the 95 % lower bound of its win-rate, {bound:.2f}, is"
    if bound > 0.5:
        return f"verdict: the candidate beats the SFT baseline ({said} above 0.5)"
    return f"verdict: not shown to beat the SFT baseline ({said} not above 0.5)"


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
    top, said = headline(m), verdict(m)

    def rows_html(rows: list[list[str]]) -> str:
        return "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)

    def head_html(names: list[str]) -> str:
        return "<tr>" + "".join(f"<th>{h}</th>" for h in names) + "</tr>\n"

    guards_html = (
        f"<h2>Guard figures</h2><table>\n{head_html(figure_head)}{rows_html(figures)}</table>" if figures else ""
    )
    top_html = f"<table>\n{rows_html(top)}</table>" if top else ""
    top_html += f"<p><b>{html.escape(said)}</b></p>" if said else ""
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kubealign {TITLE[0].lower()}{TITLE[1:]}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:4px;vertical-align:top;white-space:pre-wrap}</style></head><body>"
        f"<h1>{TITLE}</h1><p>{html.escape(ABOUT)}</p>{top_html}{guards_html}"
        f"<h2>Samples</h2><table>\n{head_html(head)}{rows_html(cells)}</table></body></html>\n"
    )

    def md(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    def md_table(names: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(names) + " |",
            "|" + "---|" * len(names),
            *("| " + " | ".join(md(c) for c in r) + " |" for r in rows),
        ]

    lines = [f"# {TITLE}", "", ABOUT, ""]
    lines += [*md_table(["figure", "value"], top), ""] if top else []
    lines += [f"**{said}**", ""] if said else []
    lines += [*md_table(figure_head, figures), ""] if figures else []
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
        fig = ppo_curves(history)
        fig.savefig(directory / "ppo_curves.png", dpi=100)
        plt.close(fig)
        made.append("ppo_curves.png")
    return made


CURVES = {  # each history key the curves draw: its panel's title, with the unit
    "reward_mean": "mean reward of the rollouts (score)",
    "kl": "KL to the SFT reference (nats per answer)",
    "policy_loss": "policy loss (dimensionless)",
    "value_loss": "value loss (squared score)",
    "group_reward_std": "reward spread within a prompt's group (score, std)",
}
CAPTION = (
    "PPO training curves of the candidate, one point per iteration: what the rollouts scored, how far the policy "
    "moved from SFT, and the two losses"
)


def ppo_curves(history: list[dict]) -> Any:
    """The training curves' figure (matplotlib): four titled panels over the iterations and a caption. A panel
    whose values are all tiny or huge (a policy loss near 1e-8) is drawn scaled, with the factor as its y label
    ("× 1e-08") and plain ticks, never a bare offset."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    steps = [h["iteration"] for h in history]
    # the fourth panel: the critic's loss for PPO; GRPO and RLOO have no critic but a group spread
    fourth = "value_loss" if "value_loss" in history[0] else "group_reward_std"
    for ax, key in zip(axes.flat, ("reward_mean", "kl", "policy_loss", fourth), strict=True):
        values = [float(h.get(key, float("nan"))) for h in history]
        largest = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
        power = math.floor(math.log10(largest)) if largest > 0 else 0
        if not -3 <= power <= 3:
            values = [v / 10.0**power for v in values]
            ax.set_ylabel(f"× 1e{power:+03d}")
        ax.plot(steps, values)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set(title=CURVES[key], xlabel="iteration")
    fig.text(0.5, 0.01, CAPTION, ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def read_history(candidate: Path) -> list[dict] | None:
    """The candidate's training history from its result.json, when a PPO run wrote it (None otherwise)."""
    try:
        result = json.loads((Path(candidate) / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return result.get("history") if result.get("stage") == "ppo" else None  # only a PPO run has these curves
