"""The synthetic task's grade of evaluate's table (kubealign.answers.grades): each model's share of well-formed,
on-topic and preferred answers by the generator's grammar, and nothing on other data."""

from __future__ import annotations

import pytest

from kubealign.answers.grades import graded
from kubealign.config import load_config
from kubealign.data import synthetic

pytestmark = pytest.mark.unit


def test_synthetic_grades_only_on_the_synthetic_task():
    prompt = synthetic.format_prompt("Tell me one fact about rain.")
    table = [
        {"prompt": prompt, "baseline": " Rain helps plants grow.", "candidate": " Of course! Rain helps plants grow."},
        {"prompt": prompt, "baseline": " Rain helps", "candidate": " Thanks for asking! Bees make honey from nectar."},
    ]
    m = graded(load_config(None), table)
    assert m["baseline_well_formed_rate"] == 0.5 and m["candidate_well_formed_rate"] == 1.0
    assert m["baseline_preferred_rate"] == 0.0 and m["candidate_preferred_rate"] == 0.5
    assert m["candidate_on_topic_rate"] == 0.5
    assert graded(load_config(None, ["data.sources=[{path: x.jsonl}]"]), table) == {}
