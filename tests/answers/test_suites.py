"""Benchmark suites through lm-eval-harness (kubealign.answers.suites): the shipped `kubealign_facts` task's rows,
the figures read from lm-eval's results, the max_suite_drop guard at its boundary and in the gate's refusal line,
and lm-eval's accuracy of two real tiny models equal to one computed here from their log-likelihoods."""

from __future__ import annotations

import pytest
import torch

from kubealign.answers import suites
from kubealign.config.guards import GuardsConfig
from kubealign.config.schema import PromoteConfig
from kubealign.config.suites import SuitesConfig
from kubealign.data import synthetic
from kubealign.data.suites import facts
from kubealign.errors import UserError
from kubealign.promotion import guards
from kubealign.promotion.gate import gate

ONLY_SUITES = GuardsConfig(
    max_logprob_drop=None,
    max_repetition_rise=None,
    min_distinct_ratio=None,
    max_empty_rise=None,
    max_unfinished_rise=None,
    min_length_ratio=None,
    max_length_ratio=None,
    min_heldout_win_rate=None,
    max_suite_drop=0.25,
)


@pytest.mark.unit
def test_facts_rows_place_the_right_fact_by_rotation():
    rows = facts.rows()
    topics = list(synthetic.FACTS)
    assert len(rows) == 2 * len(topics) == 72
    # row 5: topic 2 ("the ocean"), its second fact; the right choice in slot 5 % 4 = 1, after the second facts
    # of topics 3, 4, 5 (rain, snow, trees) that fill the other slots in order
    row = rows[5]
    assert row["answer"] == 1
    assert row["choices"] == [
        synthetic.FACTS["rain"][1],
        synthetic.FACTS["the ocean"][1],
        synthetic.FACTS["snow"][1],
        synthetic.FACTS["trees"][1],
    ]
    assert row["question"] == "\n\nHuman: What is interesting about the ocean?\n\nAssistant:"  # QUESTIONS[5]
    # the last topic's distractors wrap to the first topics
    assert rows[-1]["choices"][rows[-1]["answer"]] == synthetic.FACTS[topics[-1]][1]
    assert synthetic.FACTS[topics[0]][1] in rows[-1]["choices"]
    assert [r["answer"] for r in rows[:5]] == [0, 1, 2, 3, 0]
    for r in rows:
        assert len(set(r["choices"])) == 4
        assert synthetic.prompt_topic(r["question"]) is not None


@pytest.mark.unit
def test_suite_figures_read_the_metric_of_each_named_task():
    base = {"facts": {"acc,none": 0.75, "acc_stderr,none": "N/A", "acc_norm,none": 0.5}, "other": {"acc,none": 0.1}}
    cand = {"facts": {"acc,none": 0.5, "acc_norm,none": 0.25}}
    figures = suites.suite_figures(base, cand, ["facts"], "acc")
    assert figures == {"baseline_suite_facts": 0.75, "candidate_suite_facts": 0.5}  # "other" was not named
    assert suites.suite_figures(base, cand, ["facts"], "acc_norm")["candidate_suite_facts"] == 0.25
    # a task whose answers pass a filter reports "metric,FILTER" only: that value is read
    filtered = {"gsm": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": 0.01}}
    assert suites.suite_figures(filtered, filtered, ["gsm"], "exact_match")["baseline_suite_gsm"] == 0.125
    with pytest.raises(
        UserError, match=r"evaluate.suites.metric: task facts reports no 'f1' \(it reports: acc, acc_norm\)"
    ):
        suites.suite_figures(base, cand, ["facts"], "f1")
    with pytest.raises(UserError, match="task other reports no 'acc'"):  # the candidate's results lack it
        suites.suite_figures(base, cand, ["other"], "acc")
    with pytest.raises(UserError, match=r"task gone reports no 'acc' \(it reports: nothing\)"):
        suites.suite_figures(base, cand, ["gone"], "acc")
    # unfiltered ("none") first, wherever the task lists it
    both = {"t": {"acc,strict": 0.125, "acc,none": 0.5}}
    assert suites.suite_figures(both, both, ["t"], "acc")["candidate_suite_t"] == 0.5


def suite_metrics(**pairs: tuple[float, float]) -> dict[str, float]:
    out = {}
    for name, (base, cand) in pairs.items():
        out[f"baseline_suite_{name}"], out[f"candidate_suite_{name}"] = base, cand
    return out


@pytest.mark.unit
def test_max_suite_drop_at_its_boundary_one_line_per_suite():
    # drop exactly 0.25 passes; 2**-20 more fails; a rise is no drop
    at = guards.suite_checks(suite_metrics(a=(0.75, 0.5), b=(0.5, 0.75)), ONLY_SUITES)
    assert [c.line for c in at] == [
        "pass: suites: a drop: needs <= 0.25, got 0.250 (baseline 0.750, candidate 0.500)",
        "pass: suites: b drop: needs <= 0.25, got -0.250 (baseline 0.500, candidate 0.750)",
    ]
    over = guards.suite_checks(suite_metrics(a=(0.75, 0.5 - 2**-20)), ONLY_SUITES)
    assert [c.ok for c in over] == [False]
    assert (
        guards.suite_checks(suite_metrics(a=(0.75, 0.0)), ONLY_SUITES.model_copy(update={"max_suite_drop": None})) == []
    )
    assert guards.suite_checks({"baseline_heldout_logprob": -1.0}, ONLY_SUITES) == []  # no suite ran: no line
    # a suite the candidate lacks is not compared (evaluate writes both or neither)
    assert guards.suite_checks({"baseline_suite_a": 0.5}, ONLY_SUITES) == []
    assert guards.recorded(suite_metrics(a=(0.75, 0.5))) == ["baseline_suite_a", "candidate_suite_a"]
    both = {"baseline_distinct_2": 0.5, "candidate_distinct_2": 0.25, "heldout_win_rate": 0.5, "other": 1.0}
    assert guards.recorded({**both, **suite_metrics(a=(0.75, 0.5))}) == [
        "baseline_distinct_2",
        "candidate_distinct_2",
        "heldout_win_rate",
        "baseline_suite_a",
        "candidate_suite_a",
    ]
    assert guards.missing(suite_metrics(a=(0.75, 0.5)), ONLY_SUITES) == {}  # optional: never "missing"


@pytest.mark.unit
def test_the_gate_refuses_a_candidate_that_forgot_a_suite():
    metrics = {
        "win_rate": 0.9,
        "win_rate_lower_bound": 0.8,
        "reward_gain": 2.0,
        "kl_to_baseline": 1.0,
        "candidate_reward_mean": 1.0,
        **suite_metrics(kubealign_facts=(0.625, 0.25)),
    }
    cfg = PromoteConfig(min_win_rate=0.5, guards=ONLY_SUITES)
    passed, lines = gate(metrics, cfg, None)
    assert not passed
    assert "FAIL: suites: kubealign_facts drop: needs <= 0.25, got 0.375 (baseline 0.625, candidate 0.250)" in lines
    refusal = guards.refusal(lines, metrics)
    assert refusal.startswith("gate refused: suites: kubealign_facts drop: needs <= 0.25, got 0.375")
    assert refusal.endswith("the training reward model's gain +2.000 is not trusted (reward hacking suspected)")
    metrics["candidate_suite_kubealign_facts"] = 0.5
    assert gate(metrics, cfg, None)[0]


@pytest.mark.unit
def test_suites_config_refuses_what_it_cannot_run(tmp_path):
    assert suites.search_path(SuitesConfig(), None) == [str(suites.SHIPPED_DIR)]
    (tmp_path / "mine").mkdir()
    mine = SuitesConfig(include_path="mine")
    assert suites.search_path(mine, str(tmp_path)) == [str(tmp_path / "mine"), str(suites.SHIPPED_DIR)]  # yours first
    with pytest.raises(UserError, match=f"include_path: {tmp_path / 'absent'} is not a directory"):
        suites.search_path(SuitesConfig(include_path="absent"), str(tmp_path))
    with pytest.raises(ValueError, match="task 1 is empty"):
        SuitesConfig(tasks=["kubealign_facts", " "])
    with pytest.raises(ValueError, match="named twice"):
        SuitesConfig(tasks=["a", "a"])


def own_accuracy(model, tokenizer) -> float:
    """Multiple choice as lm-eval scores it (acc): each choice's summed log-likelihood of " CHOICE" after the
    question, the context's tokens taken from the whole string's; the highest is the model's pick."""
    right = 0
    for row in facts.rows():
        context = tokenizer(row["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = tokenizer(row["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            targets = ids[0, len(context) :]
            scores.append(logprobs[len(context) - 1 :].gather(-1, targets[:, None]).sum().item())
        right += int(max(range(len(scores)), key=scores.__getitem__) == row["answer"])
    return right / len(facts.rows())


@pytest.mark.integration
def test_lm_eval_scores_each_model_as_its_own_log_likelihoods_say():
    from kubealign.models import loading, tiny

    path = tiny.ensure("opt")
    tokenizer = loading.load_tokenizer(str(path))
    baseline = loading.load_causal_lm(str(path)).eval()
    candidate = loading.load_causal_lm(str(path)).eval()
    with torch.no_grad():  # the output head turned around: the least likely choice becomes the pick
        candidate.lm_head.weight.neg_()
    expected = {"baseline": own_accuracy(baseline, tokenizer), "candidate": own_accuracy(candidate, tokenizer)}
    assert expected["baseline"] != expected["candidate"]  # else a swap of the two could not show
    figures = suites.run(
        SuitesConfig(tasks=["kubealign_facts"]), None, {"baseline": baseline, "candidate": candidate}, tokenizer
    )
    assert figures == {
        "baseline_suite_kubealign_facts": pytest.approx(expected["baseline"]),
        "candidate_suite_kubealign_facts": pytest.approx(expected["candidate"]),
    }


@pytest.mark.slow  # lm-eval indexes its whole catalogue (~15k task files, 20 s) before it can say a name is unknown
def test_an_unknown_suite_is_one_line():
    with pytest.raises(UserError, match="evaluate.suites.tasks: no lm-eval task named no_such_suite"):
        suites.run(SuitesConfig(tasks=["no_such_suite"]), None, {"baseline": None, "candidate": None}, None)
