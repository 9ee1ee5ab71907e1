"""Every gate and guard line in one form: what was needed, then what was measured ("needs >= 0.5, got 0.400"),
so a refusal never reads as a contradiction. Hand-built metrics where each check fails and passes."""

from __future__ import annotations

import pytest

from kubealign.config.guards import GuardsConfig
from kubealign.config.schema import PromoteConfig
from kubealign.promotion import guards
from kubealign.promotion.gate import gate

pytestmark = pytest.mark.unit

OFF = dict.fromkeys(GuardsConfig.model_fields)
GOOD = {
    "win_rate": 0.6,
    "win_rate_lower_bound": 0.55,
    "reward_gain": 0.2,
    "kl_to_baseline": 1.0,
    "candidate_reward_mean": 2.5,
}
BAD = {
    "win_rate": 0.4,
    "win_rate_lower_bound": 0.4,
    "reward_gain": -0.1,
    "kl_to_baseline": 3.0,
    "candidate_reward_mean": 2.423,
}


@pytest.mark.parametrize(("metrics", "mark"), [(GOOD, "pass"), (BAD, "FAIL")])
def test_the_reward_checks_say_what_was_needed_and_what_was_measured(metrics, mark):
    cfg = PromoteConfig(min_win_rate_lower_bound=0.5, max_kl=2.0, guards=GuardsConfig(**OFF))
    _, lines = gate(metrics, cfg, {"candidate_reward_mean": 2.423})
    m = metrics
    assert lines == [
        f"{mark}: win_rate: needs >= 0.5, got {m['win_rate']:.3f}",
        f"{mark}: win_rate_lower_bound: needs >= 0.5, got {m['win_rate_lower_bound']:.3f}",
        f"{mark}: reward_gain: needs >= 0.0, got {m['reward_gain']:.3f}",
        f"{mark}: kl_to_baseline: needs <= 2.0, got {m['kl_to_baseline']:.3f}",
        f"{mark}: candidate_reward_mean: needs > 2.423 (the champion's), got {m['candidate_reward_mean']:.3f}",
    ]


def test_the_promote_metric_checks_say_whose_value_was_to_beat():
    metrics = {**GOOD, "fn/exact/candidate": 0.7, "fn/exact/baseline": 0.5}
    cfg = PromoteConfig(metric="fn/exact/candidate", min_metric=0.6, guards=GuardsConfig(**OFF))
    assert gate(metrics, cfg, {"fn/exact/candidate": 0.75})[1] == [
        "pass: reward_gain: needs >= 0.0, got 0.200",
        "pass: fn/exact/candidate: needs >= 0.6, got 0.700",
        "pass: fn/exact/candidate: needs > 0.500 (the baseline's), got 0.700",
        "FAIL: fn/exact/candidate: needs > 0.750 (the champion's), got 0.700",
    ]


GUARDS = GuardsConfig(
    max_logprob_drop=1.0,
    max_repetition_rise=0.25,
    min_distinct_ratio=0.5,
    max_empty_rise=0.25,
    max_unfinished_rise=0.25,
    min_length_ratio=0.5,
    max_length_ratio=2.0,
    min_heldout_win_rate="min_win_rate",
    min_llm_judge_win_rate="min_win_rate",
    max_suite_drop=0.25,
)


def side(who: str, logprob, repetition, distinct, empty, unfinished, length, suite) -> dict[str, float]:
    names = (
        "heldout_logprob",
        "repetition_rate",
        "distinct_2",
        "empty_rate",
        "unfinished_rate",
        "length_mean",
        "suite_facts",
    )
    return {
        f"{who}_{n}": v
        for n, v in zip(names, (logprob, repetition, distinct, empty, unfinished, length, suite), strict=True)
    }


BASE = side("baseline", -1.25, 0.25, 0.5, 0.0, 0.125, 8.0, 0.75)


def test_every_guard_line_passing():
    metrics = {
        **BASE,
        **side("candidate", -1.5, 0.25, 0.5, 0.0, 0.125, 8.0, 0.5),
        "heldout_win_rate": 0.5,
        "reward_agreement": 0.75,
        "llm_judge_win_rate": 0.625,
        "llm_judge_position_bias": 0.125,
    }
    assert [c.line for c in guards.checks(metrics, GUARDS, 0.5)] == [
        "pass: capability: held-out log-likelihood per token drop: needs <= 1.0, got 0.250 "
        "(baseline -1.250, candidate -1.500)",
        "pass: held-out reward model: win-rate: needs >= 0.5, got 0.500 "
        "(agrees with the training reward model on 75% of the prompts)",
        "pass: llm judge: win-rate in both orders: needs >= 0.5, got 0.625 (position bias 0.12)",
        "pass: suites: facts drop: needs <= 0.25, got 0.250 (baseline 0.750, candidate 0.500)",
        "pass: degeneration: repeated-bigram rate rise: needs <= 0.25, got 0.000 (baseline 0.250, candidate 0.250)",
        "pass: degeneration: empty answers rise: needs <= 0.25, got 0.000 (baseline 0.000, candidate 0.000)",
        "pass: degeneration: unfinished answers rise: needs <= 0.25, got 0.000 (baseline 0.125, candidate 0.125)",
        "pass: degeneration: distinct-2 ratio: needs >= 0.5, got 1.000 (baseline 0.500, candidate 0.500)",
        "pass: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got 1.000 (baseline 8.000, candidate 8.000)",
    ]


def test_every_guard_line_failing_and_the_refusal_reads_without_contradiction():
    metrics = {
        **BASE,
        **side("candidate", -6.75, 0.625, 0.0625, 0.5, 0.5, 32.0, 0.25),
        "heldout_win_rate": 0.467,
        "llm_judge_win_rate": 0.25,
        "win_rate": 0.95,
        "reward_gain": 3.875,
        "kl_to_baseline": 5.0,
        "candidate_reward_mean": 2.75,
    }
    lines = [c.line for c in guards.checks(metrics, GUARDS, 0.5)]
    assert lines == [
        "FAIL: capability: held-out log-likelihood per token drop: needs <= 1.0, got 5.500 "
        "(baseline -1.250, candidate -6.750)",
        "FAIL: held-out reward model: win-rate: needs >= 0.5, got 0.467",
        "FAIL: llm judge: win-rate in both orders: needs >= 0.5, got 0.250",
        "FAIL: suites: facts drop: needs <= 0.25, got 0.500 (baseline 0.750, candidate 0.250)",
        "FAIL: degeneration: repeated-bigram rate rise: needs <= 0.25, got 0.375 (baseline 0.250, candidate 0.625)",
        "FAIL: degeneration: empty answers rise: needs <= 0.25, got 0.500 (baseline 0.000, candidate 0.500)",
        "FAIL: degeneration: unfinished answers rise: needs <= 0.25, got 0.375 (baseline 0.125, candidate 0.500)",
        "FAIL: degeneration: distinct-2 ratio: needs >= 0.5, got 0.125 (baseline 0.500, candidate 0.062)",
        "FAIL: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got 4.000 (baseline 8.000, candidate 32.000)",
    ]
    refusal = guards.refusal(gate(metrics, PromoteConfig(guards=GUARDS), {"candidate_reward_mean": 2.75})[1], metrics)
    assert refusal.startswith(
        "gate refused: candidate_reward_mean: needs > 2.750 (the champion's), got 2.750; "
        "capability: held-out log-likelihood per token drop: needs <= 1.0, got 5.500"
    )
    assert "held-out reward model: win-rate: needs >= 0.5, got 0.467; llm judge:" in refusal
