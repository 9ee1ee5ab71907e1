"""`promote.guards`: what the gate asks of a candidate besides the reward it was trained to raise.

The win-rate and the reward gain are scored by the reward model the policy was optimized against: a policy
that found an exploit of it ("Happy to to to!" to every prompt) wins them. These guards compare the candidate
with the SFT baseline on figures that reward model cannot move: how well it still models held-out reference
answers, and whether its own answers degenerate. Each is on by default; None turns one off. The defaults
and why each is where it is: docs/guards.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from kubealign.config.base import Section


class GuardsConfig(Section):
    max_logprob_drop: float | None = Field(
        1.0,
        gt=0,
        description="Capability kept: the candidate's mean log-likelihood per token of the held-out reference "
        "answers (phase-1 eval demonstrations; the chosen answers of preference data) may fall at most this many "
        "nats below the baseline's (1.0 = perplexity up to e times the baseline's). None = not checked.",
    )
    max_repetition_rise: float | None = Field(
        0.2,
        ge=0,
        le=1,
        description="No degeneration: the candidate's repeated-bigram rate (the share of an answer's bigrams it "
        "already used, averaged over answers) may exceed the baseline's by at most this. None = not checked.",
    )
    min_distinct_ratio: float | None = Field(
        0.5,
        ge=0,
        le=1,
        description="No degeneration: the candidate's distinct-2 (distinct bigrams over all bigrams of all its "
        "answers) must be at least this share of the baseline's: one answer to every prompt scores near 0. "
        "None = not checked.",
    )
    max_empty_rise: float | None = Field(
        0.1,
        ge=0,
        le=1,
        description="No degeneration: the share of empty answers (EOS first) may exceed the baseline's by at most "
        "this. None = not checked.",
    )
    max_unfinished_rise: float | None = Field(
        0.25,
        ge=0,
        le=1,
        description="No degeneration: the share of answers that never end (cut at max_new_tokens) may exceed the "
        "baseline's by at most this. None = not checked.",
    )
    min_length_ratio: float | None = Field(
        0.5,
        gt=0,
        description="No degeneration: the candidate's mean answer length must be at least this times the "
        "baseline's. None = not checked.",
    )
    max_length_ratio: float | None = Field(
        2.0,
        gt=0,
        description="No degeneration: the candidate's mean answer length must be at most this times the "
        "baseline's (length is the best-known reward hack). None = not checked.",
    )

    min_heldout_win_rate: Annotated[float, Field(ge=0, le=1)] | Literal["min_win_rate"] | None = Field(
        "min_win_rate",
        description="An independent scorer: the candidate's win-rate over the baseline as the held-out reward "
        "model scores them (trained by the reward task on data.heldout_reward_fraction of phase 2, pairs the "
        "policy's reward model never saw) must be at least this; 'min_win_rate' = promote.min_win_rate, the bar "
        "the training reward model's win-rate meets. Applies when a reward model scores. None = not checked.",
    )

    min_llm_judge_win_rate: Annotated[float, Field(ge=0, le=1)] | Literal["min_win_rate"] | None = Field(
        "min_win_rate",
        description="The LLM judge (evaluate.llm_judge, off by default): the share of prompts on which it prefers "
        "the candidate in both orders of the pair must be at least this; 'min_win_rate' = promote.min_win_rate. "
        "Applies only when the evaluation, or the online judge, has the judge's figures (a judge was configured). "
        "None = not checked.",
    )

    max_suite_drop: float | None = Field(
        0.05,
        ge=0,
        description="Benchmark suites (evaluate.suites, off by default): on each suite, the candidate's score "
        "(evaluate.suites.metric, e.g. accuracy) may fall at most this far below the baseline's (0.05 = five "
        "points of accuracy). Applies only when the evaluation ran suites. None = not checked.",
    )

    min_judge_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Judges checked against people: a judge (the training reward model, the held-out one, the LLM "
        "judge) whose agreement with people's choices on the served pairs (agreement_<judge> of the latest "
        "`feedback` run of this registered model: kubealign.feedback.agreement) is below this share is not "
        "trusted: its checks are reported as 'not trusted', not counted; with every judge that checked not "
        "trusted the gate refuses. A judge people have not been asked about stays trusted. A reward model checked on "
        "people's pairs it never trained on (data.people_check_fraction) is judged by that check instead. None = not "
        "applied.",
    )

    @model_validator(mode="after")
    def _check_lengths(self) -> GuardsConfig:
        low, high = self.min_length_ratio, self.max_length_ratio
        if low is not None and high is not None and low > high:
            raise ValueError(f"promote.guards.min_length_ratio {low} is above max_length_ratio {high}")
        return self
