"""The built-in synthetic preference data carries its documented property, deterministically."""

from __future__ import annotations

import pytest

from kubealign.data import synthetic
from kubealign.data.schemas import normalize
from kubealign.errors import UserError


def test_deterministic_by_seed():
    assert synthetic.generate(50, 10, seed=1) == synthetic.generate(50, 10, seed=1)
    assert synthetic.generate(50, 10, seed=1) != synthetic.generate(50, 10, seed=2)


def test_chosen_is_courteous_and_on_topic_rejected_never_courteous():
    rows = synthetic.generate(400, 0, seed=0)
    off_topic = 0
    for row in rows:
        pair = normalize(row)
        assert synthetic.is_courteous(pair.chosen)
        assert not synthetic.is_courteous(pair.rejected)
        assert pair.rejected.strip().startswith(synthetic.DISMISSIVE)
        topic = next(t for t in synthetic.FACTS if f" {t}" in pair.prompt)
        assert pair.chosen.strip().split("!", 1)[-1].strip() in synthetic.FACTS[topic]
        fact = pair.rejected.strip()
        off_topic += not any(fact.endswith(f) for f in synthetic.FACTS[topic])
    assert 0.35 < off_topic / len(rows) < 0.65  # "half of the time" a different topic


def test_prompts_are_unique_and_sft_rows_are_prompt_response():
    rows = synthetic.generate(300, 100, seed=4)
    assert len({r["prompt"] for r in rows}) == 400
    assert all(set(r) == {"prompt", "response"} for r in rows[300:])
    assert all(r["prompt"].startswith("\n\nHuman: ") and r["prompt"].endswith("\n\nAssistant:") for r in rows)


def test_capacity_is_enforced_with_the_field_names():
    with pytest.raises(UserError, match="data.synthetic_pairs"):
        synthetic.generate(synthetic.CAPACITY, 1, seed=0)
