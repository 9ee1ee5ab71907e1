"""`evaluate.llm_judge`: an LLM that compares the baseline's and the candidate's answers (guard 4).

Any OpenAI-compatible completions endpoint (one `kubealign serve` or vLLM runs, or a hosted API) is asked, for
each evaluation prompt, which of two answers is better, once with the candidate's first and once with the
baseline's first, so a judge's preference for a slot cancels (kubealign.answers.llm_judge); the online judge
(kubealign.stages.judge) asks it the same way about the served canary's and champion's answers. Off by default:
no endpoint exists by default. The bar the candidate must meet is promote.guards.min_llm_judge_win_rate.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kubealign.config.base import Section

TEMPLATE = (
    "You are judging two answers to the same question. Reply with exactly one character: 1 if Answer 1 is "
    "better, 2 if Answer 2 is better.\n\n"
    "Question: {prompt}\n\nAnswer 1: {first}\n\nAnswer 2: {second}\n\nThe better answer is"
)
PLACEHOLDERS = ("{prompt}", "{first}", "{second}")


class LLMJudgeConfig(Section):
    """Where the judge is served and what it is asked; the API key comes from the environment, never from here."""

    url: str | None = Field(
        None,
        description="Base URL of an OpenAI-compatible server (its /v1/completions route is asked), e.g. "
        "http://127.0.0.1:8000 for `kubealign serve`. None = no LLM judge (the default).",
    )
    model: str = Field("judge", min_length=1, description="The model name the server answers to (its /v1/models).")
    max_tokens: int = Field(4, ge=1, description="max_tokens of each verdict (temperature 0): the verdict is 1 token.")
    timeout_s: float = Field(60, gt=0, description="A request not answered in this many seconds has no verdict.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    api_key_env: str | None = Field(
        "OPENAI_API_KEY",
        description="Environment variable holding the API key, sent as 'Authorization: Bearer KEY' when it is set "
        "and not empty; None = never send one.",
    )
    template: str = Field(
        TEMPLATE,
        description="The judge's prompt, with {prompt}, {first} and {second} placeholders; it must ask for exactly "
        "'1' (the first answer is better) or '2'. The first standalone 1 or 2 of the reply is the verdict.",
    )

    @field_validator("template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        lacking = [p for p in PLACEHOLDERS if p not in value]
        if lacking:
            raise ValueError(f"the template lacks {', '.join(lacking)}")
        return value
