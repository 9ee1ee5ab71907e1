"""The evaluate stage's report (kubealign.stages.evaluate_report) without a model: the samples page's LLM-judge
column, there only when the LLM judge judged. The page of a real evaluation: tests/stages/test_evaluate.py."""

from __future__ import annotations

import html

import pytest

from kubealign.stages.evaluate_report import sample_tables
from tests.answers.test_llm_judge import ROWS

pytestmark = pytest.mark.unit


def test_the_samples_page_shows_each_rows_verdict_only_with_a_judge():
    table = [
        {"prompt": p, "baseline": b, "candidate": c, "baseline_score": 0.0, "candidate_score": 1.0}
        for p, b, c in ROWS[:3]
    ]
    page, markdown = sample_tables(table)
    assert "llm judge" not in page and "llm judge" not in markdown and "no verdict" not in page
    for row, verdict in zip(table, ["candidate", "baseline", None], strict=True):
        row["llm_judge"] = verdict
    page, markdown = sample_tables(table)
    assert "<th>llm judge</th></tr>" in page
    assert "<td>1.000</td><td>candidate</td></tr>" in page and "<td>1.000</td><td>baseline</td></tr>" in page
    assert "<td>1.000</td><td>no verdict</td></tr>" in page
    samples = markdown.splitlines()[
        markdown.splitlines().index(
            "| prompt | baseline | candidate | baseline score | candidate score | llm judge |"
        ) :
    ]
    assert samples[2] == "| q1 | ab | abcd | 0.000 | 1.000 | candidate |"


METRICS = {
    "win_rate": 0.8,
    "win_rate_lower_bound": 0.7,
    "tie_rate": 0.05,
    "baseline_reward_mean": -1.417,
    "candidate_reward_mean": 2.49,
    "kl_to_baseline": 2.173,
    "baseline_preferred_rate": 0.23,
    "candidate_preferred_rate": 0.98,
    "baseline_well_formed_rate": 1.0,
    "candidate_well_formed_rate": 0.97,
}
ROW = {"prompt": "q", "baseline": "a", "candidate": "b", "baseline_score": 0.0, "candidate_score": 1.0}


def test_the_samples_page_opens_with_what_it_is_and_the_headline_figures():
    page, markdown = sample_tables([ROW], METRICS)
    assert "<title>kubealign evaluation report: the candidate against the SFT baseline</title>" in page
    body = page.split("<body>", 1)[1]
    assert body.startswith("<h1>Evaluation report: the candidate against the SFT baseline</h1>")
    assert body.index("win-rate over SFT") < body.index("<th>prompt</th>")  # the headline before the samples
    for cells in (
        ("win-rate over SFT", "0.80 (95 % lower bound 0.70), ties 0.05"),
        ("reward, SFT vs candidate", "-1.417 vs 2.490"),
        ("KL to SFT (nats per answer)", "2.173"),
        ("preferred answers", "23% (SFT) -> 98% (candidate)"),
        ("well-formed answers", "100% (SFT) -> 97% (candidate)"),
    ):
        assert "<tr><td>{}</td><td>{}</td></tr>".format(*map(html.escape, cells)) in page
        assert "| {} | {} |".format(*cells) in markdown
    verdict = "verdict: the candidate beats the SFT baseline (the 95 % lower bound of its win-rate, 0.70, is above 0.5)"
    assert f"<p><b>{verdict}</b>" in page and f"**{verdict}**" in markdown
    assert markdown.startswith("# Evaluation report: the candidate against the SFT baseline\n")


def test_the_verdict_says_when_the_win_rate_does_not_show_a_better_candidate():
    unsure = {**METRICS, "win_rate": 0.6, "win_rate_lower_bound": 0.45}
    _, markdown = sample_tables([ROW], unsure)
    assert (
        "**verdict: not shown to beat the SFT baseline (the 95 % lower bound of its win-rate, 0.45, is not above "
        "0.5)**" in markdown
    )
    worse = {k: v for k, v in METRICS.items() if "preferred" not in k and k != "win_rate_lower_bound"}
    _, markdown = sample_tables([ROW], {**worse, "win_rate": 0.4})
    assert "**verdict: the SFT baseline is preferred (win-rate 0.40, below 0.5)**" in markdown
    assert "| win-rate over SFT | 0.40, ties 0.05 |" in markdown and "preferred answers" not in markdown
    _, markdown = sample_tables([ROW])  # no metrics: the page says what it is, and no headline
    assert markdown.startswith("# Evaluation report: the candidate against the SFT baseline\n")
    assert "verdict" not in markdown


def test_the_ppo_curves_have_titles_with_units_a_readable_loss_axis_and_a_caption():
    from kubealign.stages.evaluate_report import ppo_curves

    history = [
        {"iteration": i, "reward_mean": 0.5 * i, "kl": 0.1 * i, "policy_loss": 3e-8 * (i - 1), "value_loss": 0.25}
        for i in (1, 2, 3)
    ]
    fig = ppo_curves(history)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [
        "mean reward of the rollouts (score)",
        "KL to the SFT reference (nats per answer)",
        "policy loss (dimensionless)",
        "value loss (squared score)",
    ]
    assert axes[2].get_ylabel() == "× 1e-08"  # the scale said on the axis, the ticks plain
    fig.canvas.draw()
    assert axes[2].yaxis.get_major_formatter().get_offset() == ""
    assert all("e" not in t.get_text() for t in axes[2].get_yticklabels())
    assert axes[0].get_ylabel() == ""  # a readable scale needs no factor
    assert [t.get_text() for t in fig.texts] == [
        "PPO training curves of the candidate, one point per iteration: what the rollouts scored, how far the "
        "policy moved from SFT, and the two losses"
    ]
    grpo = [{k: v for k, v in h.items() if k != "value_loss"} | {"group_reward_std": 0.5} for h in history]
    assert ppo_curves(grpo).axes[3].get_title() == "reward spread within a prompt's group (score, std)"
