"""The picture across rounds (kubealign.stages.feedback_report): each judge's agreement on each round's pairs alone,
from the pull's metrics, read back into one row per round and drawn. Hand-computed from test_served's EXPORT."""

from __future__ import annotations

import pytest

from kubealign.feedback.annotations import wilson
from kubealign.feedback.pull import served_figures
from kubealign.stages import feedback_report
from tests.feedback.test_served import EXPORT


def pulled() -> dict[str, float]:
    metrics: dict[str, float] = {}
    served_figures(EXPORT, "challenger", metrics, [])
    return metrics


def test_each_round_has_each_judges_agreement_on_its_own_pairs():
    metrics = pulled()
    # round 0: reward leans right on 1 and 3 and wrong on 2 (2 of 3); the LLM judge agrees on 1 and 3, level on 2
    assert metrics["round_0/agreement_reward"] == pytest.approx(2 / 3) and metrics["round_0/agreement_reward_n"] == 3
    assert (metrics["round_0/agreement_reward_low"], metrics["round_0/agreement_reward_high"]) == wilson(2, 3)
    assert metrics["round_0/agreement_llm_judge"] == 1.0 and metrics["round_0/agreement_llm_judge_n"] == 2
    # round 1: task 4 alone, which only the reward model judged (and rightly)
    assert metrics["round_1/agreement_reward"] == 1.0 and metrics["round_1/agreement_reward_n"] == 1
    assert not any(k.startswith("round_1/agreement_llm_judge") for k in metrics)
    assert metrics["agreement_reward"] == 0.75  # all rounds together, as before: what the gate reads


def test_the_rounds_read_back_from_the_metrics_in_round_order():
    table = feedback_report.across_rounds({"human_win_rate_weighted_round_10": 0.25, **pulled()})
    assert list(table) == [0, 1, 10]
    assert table[0]["win_rate"] == pytest.approx(1 / 3) and table[1]["win_rate"] == 1.0
    assert table[0]["judges"]["reward"] == {"rate": pytest.approx(2 / 3), "low": wilson(2, 3)[0],
                                            "high": wilson(2, 3)[1], "n": 3.0}  # fmt: skip
    assert set(table[0]["judges"]) == {"reward", "llm_judge"} and set(table[1]["judges"]) == {"reward"}
    assert table[10] == {"win_rate": 0.25, "judges": {}}
    assert feedback_report.across_rounds({"agreement_reward": 0.5, "human_win_rate_weighted": 0.4}) == {}


def test_the_table_and_the_picture(tmp_path):
    table = feedback_report.across_rounds(pulled())
    text = feedback_report.markdown(table)
    low, high = wilson(2, 3)
    assert text.splitlines()[2:] == [
        "| round | people's weighted win-rate of the challenger | llm_judge agrees | reward agrees |",
        "|---|---|---|---|",
        f"| 0 | 0.33 | 1.00 ({wilson(2, 2)[0]:.2f}-1.00, n=2) | 0.67 ({low:.2f}-{high:.2f}, n=3) |",
        f"| 1 | 1.00 | n/a | 1.00 ({wilson(1, 1)[0]:.2f}-1.00, n=1) |",
    ]
    png, md = feedback_report.write(table, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and md.read_text() == text


def test_the_kfp_page_inlines_the_picture_or_says_why_there_is_none(tmp_path):
    import base64

    from kubealign.tasks import artifacts

    drawn, empty = tmp_path / "drawn", tmp_path / "empty"
    drawn.mkdir()
    empty.mkdir()
    png, _ = feedback_report.write(feedback_report.across_rounds(pulled()), drawn)
    artifacts.rounds_report(str(drawn), str(tmp_path / "kfp" / "rounds.html"))
    page = (tmp_path / "kfp" / "rounds.html").read_text()
    assert f"src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'" in page
    assert "| 0 | 0.33 | 1.00 (" in page and "people&#x27;s weighted win-rate" in page  # the table, escaped
    artifacts.rounds_report(str(empty), str(tmp_path / "none.html"))
    assert "has been decided by people yet: no round to show" in (tmp_path / "none.html").read_text()
