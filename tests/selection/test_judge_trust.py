"""Judges checked against people in the gate (issue 79): promote.guards.min_judge_agreement turns the checks of a
judge that disagrees with people (agreement_<judge> of the latest feedback pull) into "not trusted" lines, reported
and not counted; with every judge that checked untrusted the gate refuses. Pure; by hand."""

from __future__ import annotations

import pytest

from kubealign.config.guards import GuardsConfig
from kubealign.config.schema import PromoteConfig
from kubealign.promotion import guards
from kubealign.promotion.gate import gate

pytestmark = pytest.mark.unit

# only the held-out reward model among the guards, at promote.min_win_rate
HELD = GuardsConfig(**{**dict.fromkeys(GuardsConfig.model_fields), "min_heldout_win_rate": "min_win_rate"})
CFG = PromoteConfig(
    min_win_rate=0.5, min_reward_gain=0.1, max_kl=2.0, guards=HELD.model_copy(update={"min_judge_agreement": 0.6})
)
# the training reward model says the candidate won; the held-out one says it lost
METRICS = {
    "win_rate": 0.8,
    "reward_gain": 0.3,
    "kl_to_baseline": 1.0,
    "candidate_reward_mean": 1.0,
    "heldout_win_rate": 0.3,
}


def test_a_judge_below_the_bar_is_reported_not_counted():
    people = {"agreement_heldout": 0.55, "agreement_heldout_n": 20.0, "agreement_reward": 0.9}
    passed, lines = gate({**METRICS, **people}, CFG, None)
    assert passed is True  # the held-out model's failure is not counted: people disagree with it
    assert lines[-1] == (
        "not trusted: held-out reward model: win-rate: needs >= 0.5, got 0.300 "
        "[heldout agrees with people on 0.55 over 20 tasks, below promote.guards.min_judge_agreement 0.6]"
    )
    assert lines[0] == "pass: win_rate: needs >= 0.5, got 0.800"  # the trusted one counts as before
    # at the bar it is trusted, and its failure counts again
    at_bar = gate({**METRICS, **people, "agreement_heldout": 0.6}, CFG, None)
    assert at_bar[0] is False and at_bar[1][-1].startswith("FAIL: held-out reward model: win-rate")


def test_the_training_reward_models_checks_are_its_own():
    people = {"agreement_reward": 0.4, "agreement_heldout": 0.8}
    bad = {**METRICS, "win_rate": 0.2, "reward_gain": 0.0, "heldout_win_rate": 0.7}
    passed, lines = gate({**bad, **people}, CFG, None)
    assert passed is True
    assert [line.split(":")[0] for line in lines] == ["not trusted", "not trusted", "pass", "pass"]
    assert lines[1].startswith("not trusted: reward_gain: needs >= 0.1, got 0.000 [reward agrees with people on 0.40")
    assert lines[2].startswith("pass: kl_to_baseline")  # KL is no judge's: always counted
    kl = gate({**bad, **people, "kl_to_baseline": 3.0}, CFG, None)
    assert kl[0] is False


def test_with_no_trusted_judge_the_gate_refuses():
    people = {"agreement_reward": 0.4, "agreement_heldout": 0.5}
    passed, lines = gate({**METRICS, **people}, CFG, None)
    assert passed is False
    assert lines[-1] == "FAIL: trusted judges: needs >= 1 (promote.guards.min_judge_agreement), got 0"


def test_off_or_unmeasured_it_changes_nothing():
    off = CFG.model_copy(update={"guards": HELD})
    people = {"agreement_reward": 0.1, "agreement_heldout": 0.1}
    assert gate({**METRICS, **people}, off, None) == gate(METRICS, off, None)
    assert gate(METRICS, off, None)[0] is False  # the held-out failure counts
    # never asked (no figure) or asked about no leaning task (NaN): trusted
    assert gate(METRICS, CFG, None) == gate(METRICS, off, None)
    assert gate({**METRICS, "agreement_heldout": float("nan")}, CFG, None)[0] is False
    assert guards.untrusted({"agreement_llm_judge": 0.2}, CFG.guards) == {
        "llm_judge": "agrees with people on 0.20, below promote.guards.min_judge_agreement 0.6"
    }


def test_each_check_is_filed_under_its_judge():
    assert guards.judge_of("win_rate: needs >= 0.5, got 0.8") == "reward"
    assert guards.judge_of("win_rate_lower_bound: needs >= 0.5, got 0.6") == "reward"
    assert guards.judge_of("candidate_reward_mean: needs > 1.000 (the champion's), got 1.2") == "reward"
    assert guards.judge_of("llm judge: win-rate in both orders: needs >= 0.5") == "llm_judge"
    assert guards.judge_of("degeneration: distinct-2 ratio: needs >= 0.5") is None
    assert guards.judge_of("kl_to_baseline: needs <= 2.0") is None


def test_the_online_judge_applies_the_same_setting():
    """The online judge's decision goes through the same gate: the agreement figures it was given
    (feedback.lookup.people) make a held-out model people disagree with not count there either."""
    from kubealign.config.canary import CanaryConfig
    from kubealign.serving.verdict import decide

    online = {**METRICS, "heldout_win_rate": 0.3, "win_rate_lower_bound": 0.6}
    quiet, canary = {"error_rate": 0.0, "latency_p95_s": 0.1}, CanaryConfig(min_answers=4)
    assert decide(online, 4, quiet, CFG, canary)[0] is False  # not measured: the held-out model's failure counts
    ok, lines = decide({**online, "agreement_heldout": 0.4}, 4, quiet, CFG, canary)
    assert ok and lines[-2].startswith("not trusted: held-out reward model: win-rate: needs >= 0.5, got 0.300")


def test_with_every_judge_distrusted_the_online_gate_leans_on_people():
    """People's own check (canary.min_human_win_rate) is what the judges are measured against: with every automatic
    judge untrusted it decides alone; without it, or with nothing decided, the gate refuses as before."""
    from kubealign.config.canary import CanaryConfig
    from kubealign.serving.verdict import HumanFeedback, decide

    # both judges say the candidate lost, and both disagree with people
    online = {**METRICS, "win_rate": 0.2, "heldout_win_rate": 0.3, "win_rate_lower_bound": 0.1}
    online.update(agreement_reward=0.4, agreement_heldout=0.45)
    quiet, asked = {"error_rate": 0.0, "latency_p95_s": 0.1}, CanaryConfig(min_answers=4, min_human_win_rate=0.6)
    liked = HumanFeedback(0.7, 10, "feedback run f1")
    ok, lines = decide(online, 4, quiet, CFG, asked, liked)
    assert ok is True
    assert lines[-1] == "unchecked: promote.max_kl 2.0 (KL to the champion is not measured online)"
    assert lines[-2] == (
        "pass: trusted judges: needs >= 1 (promote.guards.min_judge_agreement), got 0; the gate leans on people's "
        "win-rate alone"
    )
    assert lines[0:2] == ["pass: prompts answered by both: needs >= canary.min_answers 4, got 4",
                          "pass: people's win-rate over 10 tasks: needs >= canary.min_human_win_rate 0.6, got 0.700 (feedback run f1)"]  # fmt: skip
    # people who did not like it: their own check refuses
    disliked = decide(online, 4, quiet, CFG, asked, HumanFeedback(0.5, 10, "feedback run f1"))
    assert disliked[0] is False and disliked[1][-2].startswith("pass: trusted judges")
    assert disliked[1][1].startswith("FAIL: people's win-rate over 10 tasks")
    # nobody decided yet, or people not asked: no trusted judge, refused
    for human, canary in ((HumanFeedback(0.0, 0, "-"), asked), (liked, CanaryConfig(min_answers=4))):
        refused = decide(online, 4, quiet, CFG, canary, human)
        assert refused[0] is False
        assert refused[1][-2] == "FAIL: trusted judges: needs >= 1 (promote.guards.min_judge_agreement), got 0"


def test_forged_choices_that_distrust_every_judge_still_meet_the_degeneration_guards():
    """As an adversary with annotation rights: choices that disagree with both reward models (so neither is trusted)
    and favour a reward-hacked canary, one that repeats itself. The gate leans on people, and the guards no judge
    makes still count: the canary is refused for its repetition, and let through once it stops repeating."""
    from kubealign.config.canary import CanaryConfig
    from kubealign.config.guards import GuardsConfig
    from kubealign.serving.verdict import HumanFeedback, decide

    cfg = PromoteConfig(min_win_rate=0.5, guards=GuardsConfig(min_judge_agreement=0.6))
    same = {"length_mean": 13.0, "length_median": 13.0, "length_max": 19.0, "distinct_2": 0.3, "empty_rate": 0.0}
    same.update(unfinished_rate=0.0, repetition_rate=0.0, reward_mean=0.5, heldout_reward_mean=0.5)
    online = {f"{side}_{k}": v for side in ("baseline", "candidate") for k, v in same.items()}
    online.update(win_rate=0.2, tie_rate=0.1, win_rate_lower_bound=0.1, reward_gain=-0.2, length_drift=1.0)
    online.update(heldout_win_rate=0.2, heldout_tie_rate=0.1, reward_agreement=0.9, heldout_reward_gain=-0.2)
    online.update(reward_model_used=1.0, agreement_reward=0.1, agreement_heldout=0.1)  # forged: both distrusted
    hacked = {**online, "candidate_repetition_rate": 0.6}
    quiet, asked = {"error_rate": 0.0, "latency_p95_s": 0.1}, CanaryConfig(min_answers=4, min_human_win_rate=0.5)
    forged = HumanFeedback(1.0, 40, "feedback run forged")
    ok, lines = decide(hacked, 48, quiet, cfg, asked, forged)
    assert ok is False
    assert any(line.startswith("FAIL: degeneration: repeated-bigram rate rise") for line in lines), lines
    assert any(line.startswith("pass: trusted judges") for line in lines)
    assert decide(online, 48, quiet, cfg, asked, forged)[0] is True  # the same forgery, no repetition: promoted
