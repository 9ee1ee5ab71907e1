"""The promotion guards (issue 53): the answers' degeneration figures, each guard's check at its boundary, the
gate's refusal line, and a refused candidate never leading a comparison. Pure functions, figures by hand."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kubealign.config.guards import GuardsConfig
from kubealign.config.schema import PromoteConfig
from kubealign.promotion import guards
from kubealign.promotion.gate import gate
from kubealign.selection import ranking
from kubealign.selection.comparison import degeneration
from kubealign.stages.compare import no_leader

pytestmark = pytest.mark.unit

EOS = 2


def test_degeneration_figures_by_hand():
    rows = [
        {"tokens": [5, 6, 5, 6, EOS]},  # ended; bigrams (5,6) (6,5) (5,6): the EOS is not an answer token
        {"tokens": [EOS]},  # empty: nothing before the EOS
        {"tokens": [7, 7, 7]},  # never ended (cut at the limit); bigrams (7,7) (7,7)
    ]
    figures = degeneration(rows, EOS, "candidate")
    # 5 bigrams, 3 distinct: (5,6) (6,5) (7,7); with the EOS kept it would be 5 of 6 ((6,2) added)
    assert figures == {"candidate_distinct_2": 3 / 5, "candidate_empty_rate": 1 / 3, "candidate_unfinished_rate": 1 / 3}
    # an EOS that is not last is an ordinary token here (evaluate's rows end at the first EOS): not stripped
    assert degeneration([{"tokens": [EOS, 4, 4, 4]}], EOS, "x") == {
        "x_distinct_2": 2 / 3,  # (2,4) (4,4) (4,4)
        "x_empty_rate": 0.0,
        "x_unfinished_rate": 1.0,
    }
    assert degeneration([{"tokens": [9]}, {"tokens": []}], EOS, "b")["b_distinct_2"] == 0.0  # no bigram at all
    assert degeneration([{"tokens": []}], EOS, "b")["b_empty_rate"] == 1.0


def figures(**candidate: float) -> dict[str, float]:
    """Baseline figures, and the candidate's equal to them unless given."""
    base = {
        "heldout_logprob": -1.25,
        "repetition_rate": 0.25,
        "distinct_2": 0.5,
        "empty_rate": 0.0,
        "unfinished_rate": 0.125,
        "length_mean": 8.0,
    }
    out = {f"baseline_{k}": v for k, v in base.items()}
    out.update({f"candidate_{k}": candidate.get(k, v) for k, v in base.items()})
    return out


LIMITS = GuardsConfig(
    max_logprob_drop=1.0,
    max_repetition_rise=0.25,
    min_distinct_ratio=0.5,
    max_empty_rise=0.25,
    max_unfinished_rise=0.25,
    min_length_ratio=0.5,
    max_length_ratio=2.0,
    min_heldout_win_rate=None,
)


@pytest.mark.parametrize(
    ("figure", "holds", "fails"),
    [
        ("heldout_logprob", -2.25, -2.25 - 2**-20),  # drop exactly 1.0 passes, a hair more fails
        ("repetition_rate", 0.5, 0.5 + 2**-20),  # rise 0.25
        ("distinct_2", 0.25, 0.25 - 2**-20),  # ratio 0.5 of the baseline's
        ("empty_rate", 0.25, 0.25 + 2**-20),
        ("unfinished_rate", 0.375, 0.375 + 2**-20),
        ("length_mean", 4.0, 4.0 - 2**-20),  # half the baseline's length
        ("length_mean", 16.0, 16.0 + 2**-20),  # twice
    ],
)
def test_each_guard_holds_at_its_boundary_and_fails_past_it(figure: str, holds: float, fails: float):
    ok = guards.checks(figures(**{figure: holds}), LIMITS, 0.5)
    assert all(c.ok for c in ok), [c.line for c in ok]
    bad = [c for c in guards.checks(figures(**{figure: fails}), LIMITS, 0.5) if not c.ok]
    assert len(bad) == 1 and bad[0].ok is False
    # the same figure on the baseline's side instead moves the other way: never a failure
    swapped = figures()
    swapped[f"baseline_{figure}"], swapped[f"candidate_{figure}"] = fails, swapped[f"baseline_{figure}"]
    if figure != "length_mean":  # a length ratio is bounded on both sides
        assert all(c.ok for c in guards.checks(swapped, LIMITS, 0.5))


def test_guard_lines_say_the_figures_and_the_limit():
    lines = [
        c.line for c in guards.checks(figures(heldout_logprob=-6.75, distinct_2=0.0625, length_mean=2.0), LIMITS, 0.5)
    ]
    assert lines == [
        "FAIL: capability: held-out log-likelihood per token drop: needs <= 1.0, got 5.500 (baseline -1.250, candidate -6.750)",
        "pass: degeneration: repeated-bigram rate rise: needs <= 0.25, got 0.000 (baseline 0.250, candidate 0.250)",
        "pass: degeneration: empty answers rise: needs <= 0.25, got 0.000 (baseline 0.000, candidate 0.000)",
        "pass: degeneration: unfinished answers rise: needs <= 0.25, got 0.000 (baseline 0.125, candidate 0.125)",
        "FAIL: degeneration: distinct-2 ratio: needs >= 0.5, got 0.125 (baseline 0.500, candidate 0.062)",
        "FAIL: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got 0.250 (baseline 8.000, candidate 2.000)",
    ]


def test_a_guard_turned_off_is_not_checked_and_absent_figures_are_said():
    off = GuardsConfig(
        max_logprob_drop=None,
        max_repetition_rise=None,
        min_distinct_ratio=None,
        max_empty_rise=None,
        max_unfinished_rise=None,
        min_length_ratio=None,
        max_length_ratio=None,
        min_heldout_win_rate=None,
    )
    assert guards.checks(figures(heldout_logprob=-50.0, distinct_2=0.0), off, 0.5) == []
    only_upper = off.model_copy(update={"max_length_ratio": 2.0})
    assert [c.line for c in guards.checks(figures(length_mean=2.0), only_upper, 0.5)] == [
        "pass: degeneration: mean length ratio: needs <= 2.0, got 0.250 (baseline 8.000, candidate 2.000)"
    ]
    online = {k: v for k, v in figures().items() if "heldout" not in k}  # the judge measures no log-likelihood
    first = guards.checks(online, LIMITS, 0.5)[0]
    assert first.ok is None and first.line == "unchecked: capability: no held-out log-likelihood measured"
    assert guards.missing(online, LIMITS) == {
        "max_logprob_drop": ["baseline_heldout_logprob", "candidate_heldout_logprob"]
    }
    assert guards.missing(online, LIMITS.model_copy(update={"max_logprob_drop": None})) == {}
    with pytest.raises(ValidationError, match="min_length_ratio 3.0 is above max_length_ratio 2.0"):
        GuardsConfig(min_length_ratio=3.0)


def test_a_baseline_with_no_bigrams_or_no_length():
    zero = figures()
    zero["baseline_distinct_2"] = zero["candidate_distinct_2"] = 0.0
    assert all(c.ok for c in guards.checks(zero, LIMITS, 0.5))  # 0 -> 0 is no change
    zero["candidate_distinct_2"] = 0.5
    assert all(c.ok for c in guards.checks(zero, LIMITS, 0.5))  # more variety than none is no degeneration


HACKED = {
    "win_rate": 0.95,
    "win_rate_lower_bound": 0.88,
    "reward_gain": 3.875,
    "kl_to_baseline": 55.8,
    "candidate_reward_mean": 2.75,
    **figures(heldout_logprob=-6.75, distinct_2=0.0625),
}


def test_the_gate_refuses_a_hacked_candidate_in_one_line():
    passed, lines = gate(HACKED, PromoteConfig(min_win_rate_lower_bound=0.5), None)
    assert not passed and "pass: win_rate_lower_bound: needs >= 0.5, got 0.880" in lines
    assert guards.refusal(lines, HACKED) == (
        "gate refused: capability: held-out log-likelihood per token drop: needs <= 1.0, got 5.500 (baseline -1.250, candidate -6.750); "
        "degeneration: distinct-2 ratio: needs >= 0.5, got 0.125 (baseline 0.500, candidate 0.062); "
        "the training reward model's gain +3.875 is not trusted (reward hacking suspected)"
    )
    honest = {**HACKED, **figures(heldout_logprob=-1.5)}
    passed, lines = gate(honest, PromoteConfig(), None)
    assert passed and guards.refusal(lines, honest) == ""
    # a refusal by the reward checks alone says no more than they do
    worse = {**honest, "win_rate": 0.25, "reward_gain": -0.5}
    assert guards.refusal(gate(worse, PromoteConfig(), None)[1], worse) == (
        "gate refused: win_rate: needs >= 0.5, got 0.250; reward_gain: needs >= 0.0, got -0.500"
    )
    # a guard failing while the reward fell too: no gain to distrust
    both = {**worse, **figures(heldout_logprob=-6.75)}
    assert not guards.refusal(gate(both, PromoteConfig(), None)[1], both).endswith("(reward hacking suspected)")
    # the guards off: the hacked candidate passes, as it did before them
    off = PromoteConfig(guards=GuardsConfig(max_logprob_drop=None, min_distinct_ratio=None))
    assert gate(HACKED, off, None)[0]


def evaluation(bound: float, reward: float, kl: float, **candidate: float) -> dict[str, float]:
    return {
        "win_rate_lower_bound": bound,
        "candidate_reward_mean": reward,
        "kl_to_baseline": kl,
        **figures(**candidate),
    }


def test_a_refused_candidate_never_leads_and_says_why():
    evaluations = {
        "hacked": evaluation(0.875, 2.75, 55.8, heldout_logprob=-6.75),  # first by every key of the rule
        "honest": evaluation(0.5, 0.5, 1.0),
        "tame": evaluation(0.25, 0.25, 0.5),
    }
    refused = {"hacked": "capability: ..."}
    standings = ranking.rank(evaluations, "win_rate", ["hacked", "honest", "tame"], refused=refused)
    assert [s.candidate for s in standings] == ["honest", "tame", "hacked"]
    assert standings[2].why == "refused by a guard: capability: ..." and standings[0].why == ""
    assert [s.candidate for s in ranking.rank(evaluations, "win_rate", ["hacked", "honest", "tame"])][0] == "hacked"
    # refused and over the KL budget rank below every eligible one, among themselves by the rule
    budget = ranking.rank(evaluations, "win_rate", ["hacked", "honest", "tame"], max_kl=0.75, refused=refused)
    assert [s.candidate for s in budget] == ["tame", "hacked", "honest"]
    line = no_leader(standings[2:], None, refused)
    assert line == "no leader: a promotion guard refuses every candidate (hacked: capability: ...); nothing is promoted"
    line = no_leader(budget[1:], 0.75, refused)
    assert line == (
        "no leader: no candidate within pipeline.max_kl 0.75 (the closest, honest, has kl_to_baseline 1); "
        "the others are refused by a guard; nothing is promoted"
    )


def test_every_guard_is_checked_on_its_own_whatever_the_others():
    """A guard turned off, or whose figures are absent, does not stop the guards after it."""
    off = dict.fromkeys(GuardsConfig.model_fields)
    only_empty = GuardsConfig(**{**off, "max_empty_rise": 0.25})
    assert [c.line for c in guards.checks(figures(empty_rate=0.5), only_empty, 0.5)] == [
        "FAIL: degeneration: empty answers rise: needs <= 0.25, got 0.500 (baseline 0.000, candidate 0.500)"
    ]
    lacking = {k: v for k, v in figures(empty_rate=0.5, length_mean=32.0).items() if "repetition" not in k}
    lacking = {k: v for k, v in lacking.items() if "distinct" not in k and k != "baseline_heldout_logprob"}
    assert [c.line for c in guards.checks(lacking, LIMITS, 0.5)] == [
        "unchecked: capability: no held-out log-likelihood measured",  # one side absent is as good as both
        "unchecked: degeneration: no repeated-bigram rate in the evaluation",
        "FAIL: degeneration: empty answers rise: needs <= 0.25, got 0.500 (baseline 0.000, candidate 0.500)",
        "pass: degeneration: unfinished answers rise: needs <= 0.25, got 0.000 (baseline 0.125, candidate 0.125)",
        "unchecked: degeneration: no distinct-2 in the evaluation",
        "FAIL: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got 4.000 (baseline 8.000, candidate 32.000)",
    ]
    assert [c.line for c in guards.checks(figures(heldout_logprob=-1.5), LIMITS, 0.5)][0] == (
        "pass: capability: held-out log-likelihood per token drop: needs <= 1.0, got 0.250 (baseline -1.250, candidate -1.500)"
    )


def test_a_ratio_against_a_zero_baseline():
    zero = {**figures(), "baseline_distinct_2": 0.0, "candidate_distinct_2": 0.0, "baseline_length_mean": 0.0}
    lines = [c.line for c in guards.checks({**zero, "candidate_length_mean": 0.0}, LIMITS, 0.5)]
    assert "pass: degeneration: distinct-2 ratio: needs >= 0.5, got 1.000 (baseline 0.000, candidate 0.000)" in lines
    assert (
        "pass: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got 1.000 (baseline 0.000, candidate 0.000)"
        in lines
    )
    lines = [c.line for c in guards.checks({**zero, "candidate_length_mean": 3.0}, LIMITS, 0.5)]
    assert (
        "FAIL: degeneration: mean length ratio: needs >= 0.5 and <= 2.0, got inf (baseline 0.000, candidate 3.000)"
        in lines
    )


@pytest.mark.parametrize(
    ("failed", "gain", "distrusted"),
    [
        ("FAIL: capability: held-out ...", 0.5, True),
        ("FAIL: degeneration: distinct-2 ...", 0.5, True),
        ("FAIL: degeneration: distinct-2 ...", 0.0, False),  # no gain: nothing to distrust
        ("FAIL: win_rate: needs >= 0.5, got 0.250", 0.5, False),  # the reward checks' own failure
    ],
)
def test_the_reward_gain_is_distrusted_only_when_a_guard_failed_and_it_rose(failed, gain, distrusted):
    line = guards.refusal(["pass: reward_gain ...", failed], {"reward_gain": gain})
    assert line.startswith("gate refused: " + failed.removeprefix("FAIL: "))
    assert line.endswith("(reward hacking suspected)") is distrusted


def scored(score: float, heldout: float) -> dict[str, float]:
    return {"score": score, "heldout_score": heldout}


def test_the_heldout_reward_models_figures_by_hand():
    """Four prompts: the training scorer prefers the candidate on three; the held-out one on the first alone,
    ties the second (within comparison.TIE) and prefers the baseline on the last two."""
    from kubealign.selection.comparison import heldout_comparison

    base = [scored(0.0, 1.0), scored(0.0, 2.0), scored(1.0, 0.5), scored(2.0, 3.0)]
    cand = [scored(1.0, 1.5), scored(1.0, 2.0 + 1e-7), scored(3.0, -0.5), scored(1.0, 2.0)]
    figures = heldout_comparison(base, cand)
    assert figures["heldout_win_rate"] == 1 / 4 and figures["heldout_tie_rate"] == 1 / 4
    assert figures["baseline_heldout_reward_mean"] == (1.0 + 2.0 + 0.5 + 3.0) / 4
    assert figures["candidate_heldout_reward_mean"] == pytest.approx((1.5 + 2.0 + 1e-7 - 0.5 + 2.0) / 4)
    assert figures["heldout_reward_gain"] == pytest.approx(-1.5 / 4 + 1e-7 / 4)
    # the same call on prompt 1 (both: candidate) and prompt 4 (both: baseline); 2 and 3 differ
    assert figures["reward_agreement"] == 2 / 4


HELD = GuardsConfig(**{**dict.fromkeys(GuardsConfig.model_fields), "min_heldout_win_rate": "min_win_rate"})


@pytest.mark.parametrize("floor", [0.5, 0.625])
def test_the_heldout_win_rate_holds_at_the_bar_and_fails_below_it(floor: float):
    """'min_win_rate' is promote.min_win_rate's bar; a number of its own replaces it."""
    at = {"heldout_win_rate": floor, "reward_agreement": 0.75}
    assert [c.line for c in guards.checks(at, HELD, floor)] == [
        f"pass: held-out reward model: win-rate: needs >= {floor}, got {floor:.3f} (agrees with the training reward "
        "model on 75% of the prompts)"
    ]
    below = {"heldout_win_rate": floor - 2**-20}
    assert [c.ok for c in guards.checks(below, HELD, floor)] == [False]
    own = HELD.model_copy(update={"min_heldout_win_rate": 0.25})
    assert [c.line for c in guards.checks(below, own, floor)] == [
        f"pass: held-out reward model: win-rate: needs >= 0.25, got {floor - 2**-20:.3f}"
    ]
    assert [c.ok for c in guards.checks({"heldout_win_rate": 0.25 - 2**-20}, own, floor)] == [False]


def test_the_heldout_guard_applies_where_a_reward_model_scored_and_is_required_there():
    functions_only = {"reward_model_used": 0.0}
    assert guards.checks(functions_only, HELD, 0.5) == [] and guards.missing(functions_only, HELD) == {}
    assert guards.missing({"reward_model_used": 1.0}, HELD) == {"min_heldout_win_rate": ["heldout_win_rate"]}
    assert guards.missing({}, HELD) == {"min_heldout_win_rate": ["heldout_win_rate"]}  # an older evaluation
    assert [c.line for c in guards.checks({}, HELD, 0.5)] == [
        "unchecked: held-out reward model: none scored the answers"
    ]
    off = HELD.model_copy(update={"min_heldout_win_rate": None})
    assert guards.missing({}, off) == {} and guards.checks({"heldout_win_rate": 0.0}, off, 0.5) == []
    assert guards.recorded({"heldout_win_rate": 0.5, "reward_agreement": 1.0, "other": 2.0}) == [
        "heldout_win_rate",
        "reward_agreement",
    ]


def test_the_gate_refuses_a_candidate_the_heldout_reward_model_does_not_prefer():
    fooled = {**HACKED, **figures(), "heldout_win_rate": 0.25, "reward_agreement": 0.3}
    passed, lines = gate(fooled, PromoteConfig(), None)
    assert not passed
    assert guards.refusal(lines, fooled) == (
        "gate refused: held-out reward model: win-rate: needs >= 0.5, got 0.250 (agrees with the training reward model on 30% of "
        "the prompts); the training reward model's gain +3.875 is not trusted (reward hacking suspected)"
    )
    assert gate({**fooled, "heldout_win_rate": 0.5}, PromoteConfig(), None)[0]
    # promote.min_win_rate is the bar: a lower one lets the same figures through
    assert gate(fooled, PromoteConfig(min_win_rate=0.25), None)[0]


def test_a_standing_names_its_candidate_and_an_older_result_s_route_still_reads() -> None:
    from kubealign.selection.ranking import standing_name

    assert standing_name({"candidate": "dpo-beta-0p1", "rank": 1}) == "dpo-beta-0p1"
    assert standing_name({"route": "grpo", "rank": 2}) == "grpo"  # a compare result.json of an earlier release
    assert standing_name({"candidate": "a", "route": "b"}) == "a"
