"""The `feedback` section: people's choices from a Label Studio project as data of every run.

With `project` set, the pipeline starts with a `feedback` task: it pulls the project's completed pairwise
annotations (as `kubealign feedback pull` does: the rows, the counts, the human win-rate, a `feedback` MLflow run
whose dataset input is the file) and hands the rows to data-split, which reads them as one more source, mixed by
`weight`. The task reads a server outside KFP's view, so it is never cached: each run pulls what people have
decided by then. Unset (the default): no feedback task, the DAG as before.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kubealign.config.base import Section


class FeedbackConfig(Section):
    project: str | None = Field(
        None,
        min_length=1,
        description="The Label Studio project (its title) whose completed annotations join data.sources in every "
        "run, pulled by a `feedback` task before data-split. None = no feedback task.",
    )
    url: str = Field(
        "http://label-studio-ls-app:80",
        description="Label Studio as the pipeline's pods reach it (default: the Service of Label Studio's own Helm "
        "chart installed as release `label-studio` in the pipeline's namespace; docs/feedback.md). Pinned on the "
        "feedback task when the pipeline is compiled: a run's edited config_json cannot send the token elsewhere.",
    )
    token_secret: str = Field(
        "label-studio-token",
        min_length=1,
        description="The Kubernetes Secret whose key LABEL_STUDIO_API_KEY (a legacy API token) becomes the "
        "feedback task's environment; only that task gets it.",
    )
    weight: float = Field(
        1.0, gt=0, description="Mixing weight of people's rows in the train splits (as data.sources[i].weight)."
    )
    challenger: str = Field(
        "challenger", min_length=1, description="The alias whose human win-rate the feedback run reports."
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s) URL, got {value!r}")
        return value
