"""The promotion gate (kubealign.promotion.gate), a pure decision rule: by hand, under mutation testing."""

from __future__ import annotations

import pytest

from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError
from kubealign.promotion.gate import gate

pytestmark = pytest.mark.unit


def test_gate_by_hand():
    cfg = PromoteConfig(min_win_rate=0.5, min_reward_gain=0.1, max_kl=2.0)
    good = {"win_rate": 0.6, "reward_gain": 0.2, "kl_to_baseline": 1.0, "candidate_reward_mean": 1.0}
    assert gate(good, cfg, None)[0] is True
    assert gate({**good, "win_rate": 0.4}, cfg, None)[0] is False
    assert gate({**good, "kl_to_baseline": 3.0}, cfg, None)[0] is False
    passed, lines = gate(good, cfg, {"candidate_reward_mean": 1.5})
    assert passed is False and lines[-1].startswith("FAIL: candidate_reward_mean 1.000 > champion's 1.500")
    assert gate(good, cfg.model_copy(update={"require_beat_champion": False}), {"candidate_reward_mean": 1.5})[0]


def test_gate_on_the_win_rate_lower_bound():
    cfg = PromoteConfig(min_win_rate=0.5, min_win_rate_lower_bound=0.5)
    good = {"win_rate": 0.8, "win_rate_lower_bound": 0.62, "reward_gain": 1.0, "kl_to_baseline": 1.0,
            "candidate_reward_mean": 1.0}  # fmt: skip
    passed, lines = gate(good, cfg, None)
    assert passed and "pass: win_rate_lower_bound 0.620 >= 0.5" in lines
    # a high point estimate on few prompts: the bound below 0.5 refuses it
    passed, lines = gate({**good, "win_rate_lower_bound": 0.45}, cfg, None)
    assert not passed and "FAIL: win_rate_lower_bound 0.450 >= 0.5" in lines
    assert gate({**good, "win_rate_lower_bound": 0.5}, cfg, None)[0]  # the bound may equal the threshold
    assert gate({**good, "win_rate_lower_bound": 0.1}, PromoteConfig(), None)[0]  # unset: not checked
    with pytest.raises(UserError, match="no win_rate_lower_bound"):
        gate({k: v for k, v in good.items() if k != "win_rate_lower_bound"}, cfg, None)
