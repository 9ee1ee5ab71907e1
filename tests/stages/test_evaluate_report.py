"""The evaluate stage's report (kubealign.stages.evaluate_report) without a model: the samples page's LLM-judge
column, there only when the LLM judge judged. The page of a real evaluation: tests/stages/test_evaluate.py."""

from __future__ import annotations

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
    assert markdown.splitlines()[0].endswith("| candidate score | llm judge |")
    assert markdown.splitlines()[2] == "| q1 | ab | abcd | 0.000 | 1.000 | candidate |"
