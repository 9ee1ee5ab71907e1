"""The `canary` section: a challenger served beside the champion and judged on live traffic."""

from __future__ import annotations

from pydantic import Field, model_validator

from kubealign.config.base import Section


class CanaryConfig(Section):
    """How much traffic the canary gets (`kubealign serve --canary`) and what the online judge asks of it: the
    promote section's gate applied to the answers of both served models, and these limits besides."""

    percent: int = Field(10, ge=1, le=99, description="Share of the traffic (%) the canary alias gets.")
    prompts: int = Field(64, ge=1, description="Held-out prompts the judge sends to both models.")
    min_answers: int = Field(
        32, ge=1, description="Never promote on fewer prompts answered by both models (errors do not count)."
    )
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Roll back above this share of failed canary requests (HTTP errors, timeouts, garbage).",
    )
    max_latency_p95_s: float | None = Field(
        None, gt=0, description="Roll back when the canary's 95th-percentile latency exceeds this; None = no limit."
    )
    request_timeout_s: float = Field(60, gt=0, description="A request not answered in this time is an error.")
    concurrency: int = Field(4, ge=1, description="Requests in flight to each model at once.")
    max_new_tokens: int = Field(64, ge=1, description="max_tokens of each completion (temperature 0).")
    min_human_win_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Also require people's win-rate of the canary's version over the champion (the latest "
        "`kubealign feedback pull` for that version in tracking.experiment) to reach this; None: not asked "
        "(docs/feedback.md).",
    )
    act: bool = Field(
        True,
        description="The pipeline's act task, after its judge task, carries the judge's verdict out (registry, "
        "then the InferenceService) as the pipeline identity; false: no act task, the judge only reports.",
    )
    await_people: bool = Field(
        False,
        description="With canary.min_human_win_rate: a canary that passes every other check while people have not "
        "decided on its version yet is neither promoted nor rolled back; it keeps serving canary.percent % and the "
        "pipeline's next run settles it once its feedback task has pulled their choices (docs/feedback.md, "
        '"Holding the canary for people"); false: no choices yet is a failed check, rolled back at once.',
    )

    @model_validator(mode="after")
    def _check_await(self) -> CanaryConfig:
        if self.await_people and self.min_human_win_rate is None:
            raise ValueError("canary.await_people needs canary.min_human_win_rate (the people's check it waits for)")
        return self
