"""Answers in turns with tools (kubealign.answers.turns): each model's tool-use figures from its sample rows, by
hand, and the line the run's summary makes of them. The turn loop itself: tests/rl/test_multiturn.py."""

from __future__ import annotations

import pytest

from kubealign.answers.turns import turn_figures
from kubealign.cli.summary import evaluate_lines

pytestmark = pytest.mark.unit


def test_evaluates_turn_figures_per_model():
    base = [{"turns": 1, "calls": 0, "malformed": 0}, {"turns": 2, "calls": 1, "malformed": 1}]
    cand = [
        {"turns": 2, "calls": 1, "malformed": 0},
        {"turns": 3, "calls": 2, "malformed": 1},
        {"turns": 1, "calls": 0, "malformed": 0},
    ]
    assert turn_figures(base, cand) == {
        "tool_call_rate/baseline": 0.5,
        "malformed_call_rate/baseline": 1.0,
        "turns_mean/baseline": 1.5,
        "tool_call_rate/candidate": 2 / 3,
        "malformed_call_rate/candidate": 1 / 3,
        "turns_mean/candidate": 2.0,
    }
    assert turn_figures([{"ids": 0}], [{"ids": 0}]) == {}  # single-turn rows: no figures
    m = {"baseline_reward_mean": 0.0, "candidate_reward_mean": 1.0, "win_rate": 1.0, "tie_rate": 0.0}
    m.update(kl_to_baseline=0.5, **turn_figures(base, cand))
    assert "tool calls 50% of answers (SFT) -> 67% (GRPO), malformed 100% -> 33%, turns 1.50 -> 2.00" in (
        evaluate_lines(m, "GRPO")
    )
