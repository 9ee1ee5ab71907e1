"""The promotion gate (kubealign.promotion.gate), a pure decision rule: by hand, under mutation testing."""

from __future__ import annotations

import pytest

from kubealign.config.guards import GuardsConfig
from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError
from kubealign.promotion.gate import gate

pytestmark = pytest.mark.unit

# The reward checks alone: the guards (promote.guards, on by default) have tests of their own (test_guards.py);
# with their figures absent from these metrics they would add "unchecked: " lines.
NO_GUARDS = GuardsConfig(**dict.fromkeys(GuardsConfig.model_fields))


def test_gate_by_hand():
    cfg = PromoteConfig(min_win_rate=0.5, min_reward_gain=0.1, max_kl=2.0, guards=NO_GUARDS)
    good = {"win_rate": 0.6, "reward_gain": 0.2, "kl_to_baseline": 1.0, "candidate_reward_mean": 1.0}
    assert gate(good, cfg, None)[0] is True
    assert gate({**good, "win_rate": 0.4}, cfg, None)[0] is False
    assert gate({**good, "kl_to_baseline": 3.0}, cfg, None)[0] is False
    passed, lines = gate(good, cfg, {"candidate_reward_mean": 1.5})
    assert passed is False and lines[-1].startswith(
        "FAIL: candidate_reward_mean: needs > 1.500 (the champion's), got 1.000"
    )
    assert gate(good, cfg.model_copy(update={"require_beat_champion": False}), {"candidate_reward_mean": 1.5})[0]


def test_gate_on_the_win_rate_lower_bound():
    cfg = PromoteConfig(min_win_rate=0.5, min_win_rate_lower_bound=0.5)
    good = {
        "win_rate": 0.8,
        "win_rate_lower_bound": 0.62,
        "reward_gain": 1.0,
        "kl_to_baseline": 1.0,
        "candidate_reward_mean": 1.0,
    }
    passed, lines = gate(good, cfg, None)
    assert passed and "pass: win_rate_lower_bound: needs >= 0.5, got 0.620" in lines
    # a high point estimate on few prompts: the bound below 0.5 refuses it
    passed, lines = gate({**good, "win_rate_lower_bound": 0.45}, cfg, None)
    assert not passed and "FAIL: win_rate_lower_bound: needs >= 0.5, got 0.450" in lines
    assert gate({**good, "win_rate_lower_bound": 0.5}, cfg, None)[0]  # the bound may equal the threshold
    assert gate({**good, "win_rate_lower_bound": 0.1}, PromoteConfig(), None)[0]  # unset: not checked
    with pytest.raises(UserError, match="no win_rate_lower_bound"):
        gate({k: v for k, v in good.items() if k != "win_rate_lower_bound"}, cfg, None)


GOOD = {"win_rate": 0.5, "reward_gain": 0.1, "kl_to_baseline": 2.0, "candidate_reward_mean": 1.0}


def test_every_threshold_holds_at_its_boundary():
    """A value equal to its threshold passes (>= / <=); beating the champion needs strictly more."""
    cfg = PromoteConfig(min_win_rate=0.5, min_reward_gain=0.1, max_kl=2.0, guards=NO_GUARDS)
    passed, lines = gate(GOOD, cfg, None)
    assert passed and lines == [
        "pass: win_rate: needs >= 0.5, got 0.500",
        "pass: reward_gain: needs >= 0.1, got 0.100",
        "pass: kl_to_baseline: needs <= 2.0, got 2.000",
    ]
    for key, worse in (("win_rate", 0.4999), ("reward_gain", 0.0999), ("kl_to_baseline", 2.0001)):
        assert gate({**GOOD, key: worse}, cfg, None)[0] is False, key
    passed, lines = gate(GOOD, cfg, {"candidate_reward_mean": 1.0})  # a tie with the champion
    assert not passed and lines[-1] == "FAIL: candidate_reward_mean: needs > 1.000 (the champion's), got 1.000"
    bound = cfg.model_copy(update={"min_win_rate_lower_bound": 0.3})
    with pytest.raises(UserError, match=r"^promote\.min_win_rate_lower_bound is set but the evaluation has no"):
        gate(GOOD, bound, None)


def test_promote_metric_boundaries_a_missing_baseline_and_a_champion_without_it():
    evaluation = {**GOOD, "fn/exact/candidate": 0.6}  # no fn/exact/baseline: no baseline check
    cfg = PromoteConfig(metric="fn/exact/candidate", min_metric=0.6, guards=NO_GUARDS)
    passed, lines = gate(evaluation, cfg, None)
    assert passed and lines == [
        "pass: reward_gain: needs >= 0.0, got 0.100",
        "pass: fn/exact/candidate: needs >= 0.6, got 0.600",
    ]
    passed, lines = gate(evaluation, cfg, {"fn/exact/candidate": 0.6})  # the champion's equal value: not beaten
    assert not passed and lines[-1] == "FAIL: fn/exact/candidate: needs > 0.600 (the champion's), got 0.600"
    passed, lines = gate(evaluation, cfg, {"candidate_reward_mean": 5.0})  # registered before the metric existed
    assert passed and lines[-1] == "pass: fn/exact/candidate: the champion has none recorded, not compared"
    with pytest.raises(UserError, match=r"the evaluation has no such metric \(no fn/ metrics\)$"):
        gate(GOOD, cfg, None)


def test_function_totals_add_to_earlier_ones_and_means_name_the_metric():
    from kubealign.rewards.totals import function_means, function_totals

    first = function_totals({"f": [1.0, None], "g": [None]})
    assert first == {"f": (1.0, 1), "g": (0.0, 0)}
    both = function_totals({"f": [3.0, 4.0]}, into=first)
    assert both == {"f": (8.0, 3), "g": (0.0, 0)} and first == {"f": (1.0, 1), "g": (0.0, 0)}  # a new dict
    assert function_means(both) == {"fn/f": 8.0 / 3}  # g applied to nothing: no metric
    assert function_means(both, "/candidate") == {"fn/f/candidate": 8.0 / 3}


def test_a_tie_counts_what_promote_tie_credit_says_in_both_reward_models_win_rates():
    """Greedy answers of close models tie often: wins 0.30, ties 0.50, losses 0.20 is better than its champion,
    and only counting a tie as half a win (0.55) says so; the held-out model's 0.25 + 0.5 x 0.40 = 0.45 does not."""
    held = GuardsConfig(**{**dict.fromkeys(GuardsConfig.model_fields), "min_heldout_win_rate": "min_win_rate"})
    metrics = {"win_rate": 0.3, "tie_rate": 0.5, "reward_gain": 0.1, "kl_to_baseline": 0.2}
    metrics.update(candidate_reward_mean=1.0, heldout_win_rate=0.25, heldout_tie_rate=0.4)
    strict = PromoteConfig(min_win_rate=0.5, guards=held)
    passed, lines = gate(metrics, strict, None)
    assert not passed and lines[0] == "FAIL: win_rate: needs >= 0.5, got 0.300"
    assert lines[-1] == "FAIL: held-out reward model: win-rate: needs >= 0.5, got 0.250"
    half = strict.model_copy(update={"tie_credit": 0.5})
    passed, lines = gate(metrics, half, None)
    assert lines[0] == "pass: win_rate: needs >= 0.5, got 0.550 (wins 0.300 + 0.5 x ties 0.500)"
    assert lines[-1] == "FAIL: held-out reward model: win-rate: needs >= 0.5, got 0.450 (wins 0.250 + 0.5 x ties 0.400)"
    assert not passed
    passed, lines = gate({**metrics, "heldout_tie_rate": 0.5}, half, None)  # 0.25 + 0.25: at the bar
    assert passed and lines[-1].startswith("pass: held-out reward model: win-rate: needs >= 0.5, got 0.500")
