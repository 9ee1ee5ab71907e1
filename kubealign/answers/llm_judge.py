"""The LLM judge (evaluate.llm_judge): an LLM behind an OpenAI-compatible completions route asked which of two
answers to a prompt is better, the rules that turn its replies into verdicts, and the figures
promote.guards.min_llm_judge_win_rate reads. Evaluate asks it about the baseline's and the candidate's answers,
the online judge (stages.judge) about the champion's and the canary's, both through `llm_judged`.

LLM judges prefer a slot (most often the first: Zheng et al. 2023, "Judging LLM-as-a-Judge", position bias),
so each pair is asked twice, the candidate's answer first and then the baseline's first. The candidate wins a
prompt only when preferred in both orders and loses only when the baseline is; anything else is a tie, so a
judge that always names the same slot makes every prompt a tie and wins nothing. A reply without a verdict
(or a failed request) leaves its prompt unjudged: no win, no loss, no tie. The rates are shares of all
prompts, so a flaky judge cannot pass a candidate on the few prompts it answered. The rules (fill to tally)
are pure; `ask` is the requests (kubealign.serving.ask.complete, greedy).
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

from kubealign.config.llm_judge import LLMJudgeConfig
from kubealign.config.schema import EvaluateConfig
from kubealign.errors import UserError
from kubealign.serving.ask import Limits, complete

FIRST, SECOND = 1, 2  # the slots a verdict names
# a standalone 1 or 2: not part of a longer number ("12", "1.5", "21")
_VERDICT = re.compile(r"(?<![\d.])([12])(?![\d]|\.\d)")
_SLOT = re.compile(r"\{(prompt|first|second)\}")


class Judged(NamedTuple):
    """verdicts: per prompt "candidate" | "baseline" | "tie", None when a reply had no verdict; figures: the
    llm_judge_* metrics."""

    verdicts: list[str | None]
    figures: dict[str, float]


def fill(template: str, prompt: str, first: str, second: str) -> str:
    """The template with its placeholders replaced in one pass (an answer that itself holds "{second}" stays
    as it is; str.format would also choke on any other brace in an answer)."""
    values = {"prompt": prompt, "first": first, "second": second}
    return _SLOT.sub(lambda m: values[m.group(1)], template)


def pair_prompts(template: str, prompt: str, baseline: str, candidate: str) -> tuple[str, str]:
    """(the candidate's answer in the first slot, the baseline's answer in the first slot)."""
    return fill(template, prompt, candidate, baseline), fill(template, prompt, baseline, candidate)


def parse(reply: str | None) -> int | None:
    """The slot a reply names: the first standalone 1 or 2 in it (" 1", "Answer 2.", "**1**"); None for no
    reply or none there ("both", "12", "1.5")."""
    if reply is None:
        return None
    found = _VERDICT.search(reply)
    return None if found is None else int(found.group(1))


def combine(candidate_first: int | None, baseline_first: int | None) -> str | None:
    """One prompt's verdict from the slots named in its two orders."""
    if candidate_first is None or baseline_first is None:
        return None
    if candidate_first == FIRST and baseline_first == SECOND:
        return "candidate"
    if candidate_first == SECOND and baseline_first == FIRST:
        return "baseline"
    return "tie"  # the same slot both times: the judge's position, not the answers, decided


def tally(replies: list[tuple[str | None, str | None]]) -> Judged:
    """Per prompt (reply with the candidate first, reply with the baseline first), None for a failed request:
    the verdicts and llm_judge_win_rate / _loss_rate / _tie_rate (shares of all prompts), llm_judge_unparsed
    (share of replies without a verdict) and, when any reply had one, llm_judge_position_bias (share of the
    verdicts that named the first slot: 0.5 = none, 1.0 = always the first)."""
    slots = [(parse(a), parse(b)) for a, b in replies]
    verdicts = [combine(a, b) for a, b in slots]
    prompts = max(len(replies), 1)
    named = [s for pair in slots for s in pair if s is not None]
    figures = {
        "llm_judge_win_rate": verdicts.count("candidate") / prompts,
        "llm_judge_loss_rate": verdicts.count("baseline") / prompts,
        "llm_judge_tie_rate": verdicts.count("tie") / prompts,
        "llm_judge_unparsed": (2 * len(replies) - len(named)) / (2 * prompts),
    }
    if named:
        figures["llm_judge_position_bias"] = named.count(FIRST) / len(named)
    return Judged(verdicts, figures)


def ask(cfg: LLMJudgeConfig, table: list[dict[str, Any]]) -> Judged:
    """Both orders of every row's pair (evaluate's table: "prompt", "baseline", "candidate" texts) to the judge
    at cfg.url; a failed request is a reply without a verdict. One line naming the URL when every one fails."""
    assert cfg.url is not None, "the LLM judge is asked only with evaluate.llm_judge.url"
    prompts = [p for row in table for p in pair_prompts(cfg.template, row["prompt"], row["baseline"], row["candidate"])]
    api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    answers = complete(cfg.url, cfg.model, prompts, Limits(cfg.max_tokens, cfg.timeout_s, cfg.concurrency), api_key)
    if answers and not any(a.ok for a in answers):
        raise UserError(
            f"evaluate.llm_judge: no request to {cfg.url}/v1/completions was answered ({answers[0].error}); "
            "start the judge's server, fix evaluate.llm_judge.url / model, or set evaluate.llm_judge.url: null"
        )
    texts = [a.text if a.ok else None for a in answers]
    return tally(list(zip(texts[0::2], texts[1::2], strict=True)))


def llm_judged(cfg: EvaluateConfig, table: list[dict[str, Any]]) -> dict[str, float]:
    """When evaluate.llm_judge.url is set: the LLM judge's figures, each row's verdict as "llm_judge"
    (candidate | baseline | tie, None without one). Otherwise nothing, and nothing asked."""
    if cfg.llm_judge.url is None or not table:
        return {}
    judged = ask(cfg.llm_judge, table)
    for row, verdict in zip(table, judged.verdicts, strict=True):
        row["llm_judge"] = verdict
    return judged.figures
