"""The LLM judge (kubealign.answers.llm_judge), a guard the trained reward model has no part in: the two prompts
of a pair, a reply's verdict, both orders combined (a judge that always names one slot wins nothing), its guard at
the boundary, its requests against a stand-in completions server on 127.0.0.1 (tests/support/llm_stand_in.py)
that judges by length and fails some requests, and each row's verdict written into evaluate's table. Figures by
hand."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from kubealign.answers.llm_judge import ask, combine, llm_judged, pair_prompts, parse, tally
from kubealign.config.guards import GuardsConfig
from kubealign.config.llm_judge import LLMJudgeConfig
from kubealign.config.schema import EvaluateConfig
from kubealign.errors import UserError
from kubealign.promotion import guards
from tests.support.llm_stand_in import ANSWERS, StandIn, longer

pytestmark = pytest.mark.unit

TEMPLATE = LLMJudgeConfig().template


ROWS = [  # prompt, baseline, candidate
    ("q1", "ab", "abcd"),  # the candidate's longer: it wins in both orders
    ("q2", "abcdef", "a"),  # the baseline's longer: it wins in both orders
    ("q3", "abc", "abcde"),  # the candidate again
    ("q4", "xy", "zw"),  # as long: "1" both times, the first slot each time -> tie
]


def replies_of(answer, rows=ROWS) -> list[tuple[str | None, str | None]]:
    return [tuple(answer(p) for p in pair_prompts(TEMPLATE, *row)) for row in rows]


def test_each_order_puts_each_answer_in_its_slot():
    candidate_first, baseline_first = pair_prompts(TEMPLATE, "Why {x}?", "BASE {second}", "CAND")
    assert ANSWERS.search(candidate_first).groupdict() == {"first": "CAND", "second": "BASE {second}"}
    assert ANSWERS.search(baseline_first).groupdict() == {"first": "BASE {second}", "second": "CAND"}
    assert "Question: Why {x}?\n" in candidate_first  # braces of a prompt or an answer are left alone


@pytest.mark.parametrize(
    ("reply", "slot"),
    [("1", 1), (" 2", 2), ("Answer 2.", 2), ("**1** is better", 1), ("2\n1", 2), ("1, not 2", 1)],
)
def test_the_first_standalone_1_or_2_is_the_verdict(reply, slot):
    assert parse(reply) == slot


@pytest.mark.parametrize("reply", [None, "", "both", "12", "1.5", "21", "3", "A"])
def test_a_reply_without_a_verdict(reply):
    assert parse(reply) is None


def test_both_orders_must_agree():
    assert combine(1, 2) == "candidate"  # first when first, second when second: the candidate both times
    assert combine(2, 1) == "baseline"
    assert combine(1, 1) == combine(2, 2) == "tie"  # the slot decided, not the answer
    assert combine(None, 2) is combine(1, None) is None


def test_a_judge_that_always_says_first_wins_nothing():
    verdicts, figures = tally(replies_of(lambda prompt: "1"))
    assert verdicts == ["tie"] * 4
    assert figures == {
        "llm_judge_win_rate": 0.0,
        "llm_judge_loss_rate": 0.0,
        "llm_judge_tie_rate": 1.0,
        "llm_judge_unparsed": 0.0,
        "llm_judge_position_bias": 1.0,
    }


def test_a_judge_of_length_by_hand():
    verdicts, figures = tally(replies_of(longer))
    assert verdicts == ["candidate", "baseline", "candidate", "tie"]
    # slots named: q1 1,2; q2 2,1; q3 1,2; q4 1,1 -> the first 5 times of 8
    assert figures == {
        "llm_judge_win_rate": 0.5,
        "llm_judge_loss_rate": 0.25,
        "llm_judge_tie_rate": 0.25,
        "llm_judge_unparsed": 0.0,
        "llm_judge_position_bias": 5 / 8,
    }


def test_replies_without_a_verdict_are_counted_and_judge_no_prompt():
    replies = replies_of(longer)
    replies[0] = (replies[0][0], "I cannot decide")  # q1: one order unparsed -> no verdict for q1
    replies[1] = (None, None)  # q2: both requests failed
    verdicts, figures = tally(replies)
    assert verdicts == [None, None, "candidate", "tie"]
    # shares of all 4 prompts: a win on 1 of them; 3 of 8 replies lack a verdict; slots named: 1; 1,2; 1,1
    assert figures == {
        "llm_judge_win_rate": 0.25,
        "llm_judge_loss_rate": 0.0,
        "llm_judge_tie_rate": 0.25,
        "llm_judge_unparsed": 3 / 8,
        "llm_judge_position_bias": 4 / 5,
    }
    assert "llm_judge_position_bias" not in tally([(None, "no")]).figures  # no slot named: no bias measured


def test_the_config_is_off_by_default_and_checks_its_template():
    assert EvaluateConfig().llm_judge.url is None
    with pytest.raises(ValidationError, match=r"lacks \{second\}"):
        LLMJudgeConfig(template="{prompt} {first}")
    with pytest.raises(ValidationError):
        LLMJudgeConfig(api_key="secret")  # the key comes from the environment only


JUDGED = {
    "llm_judge_win_rate": 0.5,
    "llm_judge_loss_rate": 0.25,
    "llm_judge_tie_rate": 0.25,
    "llm_judge_unparsed": 0.0,
    "llm_judge_position_bias": 0.625,
}
ONLY = GuardsConfig(
    max_logprob_drop=None,
    max_repetition_rise=None,
    min_distinct_ratio=None,
    max_empty_rise=None,
    max_unfinished_rise=None,
    min_length_ratio=None,
    max_length_ratio=None,
    min_heldout_win_rate=None,
    min_llm_judge_win_rate=0.5,
)


def test_the_guard_at_its_boundary():
    (check,) = guards.checks(JUDGED, ONLY, 0.9)
    assert check.ok is True
    assert check.text == "llm judge: win-rate in both orders: needs >= 0.5, got 0.500 (position bias 0.62)"
    (check,) = guards.checks({**JUDGED, "llm_judge_win_rate": 0.5 - 2**-20}, ONLY, 0.0)
    assert check.ok is False and check.text.startswith("llm judge: win-rate in both orders: needs >= 0.5, got 0.500")


def test_one_prompt_is_the_whole_share_and_no_verdict_no_bias():
    one = tally([("1", "2")])  # candidate first and preferred, then second and preferred: a win
    assert one.verdicts == ["candidate"] and one.figures["llm_judge_win_rate"] == 1.0
    none = tally([(None, "maybe")])  # no verdict at all: no position bias to speak of, and no line for it
    assert "llm_judge_position_bias" not in none.figures and none.figures["llm_judge_unparsed"] == 1.0
    (check,) = guards.checks(none.figures, ONLY, 0.0)
    assert check.text == "llm judge: win-rate in both orders: needs >= 0.5, got 0.000"


def test_min_win_rate_is_the_gates_bar():
    same = ONLY.model_copy(update={"min_llm_judge_win_rate": "min_win_rate"})
    assert GuardsConfig().min_llm_judge_win_rate == "min_win_rate"
    assert [c.ok for c in guards.checks(JUDGED, same, 0.5)] == [True]
    assert [c.ok for c in guards.checks(JUDGED, same, 0.5 + 2**-20)] == [False]
    off = ONLY.model_copy(update={"min_llm_judge_win_rate": None})
    assert guards.checks(JUDGED, off, 0.0) == []


def test_no_judge_no_line_and_nothing_missing():
    assert guards.checks({}, ONLY, 0.5) == []
    assert guards.missing({}, GuardsConfig(min_heldout_win_rate=None)) == {
        f: [f"{who}_{name}" for who in ("baseline", "candidate")]
        for f, name in guards.FIGURES.items()  # every default guard but the judge's
    }
    assert "min_llm_judge_win_rate" not in guards.missing({}, GuardsConfig())


def test_a_failed_judge_refuses_and_its_figures_are_recorded():
    lines = [c.line for c in guards.checks({**JUDGED, "llm_judge_win_rate": 0.25}, ONLY, 0.5)]
    refusal = guards.refusal(lines, {"reward_gain": 1.5})
    assert refusal == (
        "gate refused: llm judge: win-rate in both orders: needs >= 0.5, got 0.250 (position bias 0.62); "
        "the training reward model's gain +1.500 is not trusted (reward hacking suspected)"
    )
    assert guards.recorded({**JUDGED, "other": 1.0}) == list(JUDGED)


@pytest.fixture
def stand_in():
    served = StandIn(longer)
    yield served
    served.stop()


def test_the_judge_over_http_with_a_failed_request(stand_in, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "k-123")
    cfg = LLMJudgeConfig(url=stand_in.url, model="judge-7b", timeout_s=10, concurrency=3, api_key_env="JUDGE_KEY")
    table = [{"prompt": p, "baseline": b, "candidate": c} for p, b, c in ROWS]
    table.append({"prompt": "q5 FAIL", "baseline": "a", "candidate": "abc"})  # both its requests answer 500
    verdicts, figures = ask(cfg, table)
    assert verdicts == ["candidate", "baseline", "candidate", "tie", None]
    assert figures == {
        "llm_judge_win_rate": 2 / 5,
        "llm_judge_loss_rate": 1 / 5,
        "llm_judge_tie_rate": 1 / 5,
        "llm_judge_unparsed": 2 / 10,
        "llm_judge_position_bias": 5 / 8,
    }
    assert len(stand_in.seen) == 10
    assert {(r["model"], r["temperature"], r["max_tokens"], key) for r, key in stand_in.seen} == {
        ("judge-7b", 0, 4, "Bearer k-123")
    }
    monkeypatch.delenv("JUDGE_KEY")
    ask(cfg, table[:1])
    assert stand_in.seen[-1][1] is None  # no key in the environment: no header


def test_every_request_failing_is_one_line_naming_the_url(stand_in):
    cfg = LLMJudgeConfig(url=stand_in.url, timeout_s=10)
    with pytest.raises(
        UserError, match=rf"^evaluate.llm_judge: no request to {re.escape(stand_in.url)}/v1/completions"
    ):
        ask(cfg, [{"prompt": "FAIL", "baseline": "a", "candidate": "b"}])


def test_evaluate_writes_each_rows_verdict(stand_in):
    table = [{"prompt": p, "baseline": b, "candidate": c} for p, b, c in ROWS[:2]]
    assert llm_judged(EvaluateConfig(), table) == {} and "llm_judge" not in table[0]  # off: not asked
    cfg = EvaluateConfig(llm_judge=LLMJudgeConfig(url=stand_in.url, timeout_s=10))
    assert llm_judged(cfg, table)["llm_judge_win_rate"] == 0.5
    assert [row["llm_judge"] for row in table] == ["candidate", "baseline"]
