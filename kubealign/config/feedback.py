"""The `feedback` section: people's choices from a Label Studio project as data of every run.

With `project` set, the pipeline starts with a `feedback` task: it pulls the project's completed pairwise
annotations (as `kubealign feedback pull` does: the rows, the counts, the human win-rate, a `feedback` MLflow run
whose dataset input is the file) and hands the rows to data-split, which reads them as one more source, mixed by
`weight`. The task reads a server outside KFP's view, so it is never cached: each run pulls what people have
decided by then. Unset (the default): no feedback task, the DAG as before.
"""

from __future__ import annotations

from urllib.parse import urlsplit

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
    deadline_s: float = Field(
        600.0,
        gt=0,
        description="Seconds a pull may take in all, every call to Label Studio together (connect, reading the "
        "export): a server that answers slowly, or a byte at a time, is cut off then (one line). Each read also "
        "waits 30 s at most.",
    )
    max_export_mb: float = Field(
        256.0,
        gt=0,
        description="MiB (2**20 bytes) of one reply from Label Studio at most (the export is the largest): a larger "
        "one is refused as it arrives, before it is parsed.",
    )

    budget: int = Field(
        64,
        ge=1,
        description="Tasks a round pushes from what the canary served (`kubealign feedback push --from-judge`, "
        "`kubealign round next`): at most this many of the judge's answered pairs.",
    )
    random_share: float = Field(
        0.25,
        ge=0,
        le=1,
        description="The share of `budget` drawn at random from the served pairs left once the pairs where the "
        "automatic judges disagree most (one judge alone: where it is least sure) are taken; each random task is "
        "weighted by the pairs it stands for, so the weighted human win-rate stays unbiased (docs/feedback.md "
        "'Rounds'). 0 = disagreement only (the win-rate is then of those pairs), 1 = all at random.",
    )
    round: int = Field(
        0,
        ge=0,
        description="This run's round of the feedback loop (0: the first, before any people's choice), tagged "
        "on its MLflow runs as kubealign.round; `kubealign round next` sets it to the last round's plus one.",
    )
    previous_run: str | None = Field(
        None,
        min_length=1,
        description="The MLflow run id of the previous round's pipeline run, tagged on this run's MLflow runs as "
        "kubealign.previous_run (`kubealign round next` sets it). None = no previous round.",
    )

    @property
    def round_tags(self) -> dict[str, str]:
        """The MLflow tags that say which round a run is and which run came before it."""
        tags = {"kubealign.round": str(self.round)}
        if self.previous_run is not None:
            tags["kubealign.previous_run"] = self.previous_run
        return tags

    @property
    def max_bytes(self) -> int:
        return int(self.max_export_mb * (1 << 20))

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s) URL, got {value!r}")
        refusal = credentials_refusal(value)
        if refusal:
            raise ValueError(refusal)
        return value


def credentials_refusal(url: str) -> str | None:
    """Why `url` may not be Label Studio's address when it holds credentials (user:password@, or a user name in an
    http(s) URL: the rule kubealign.tracking.runs.check_uri applies to tracking.uri), with them masked; None when
    it holds none. The URL is pinned into the compiled pipeline and printed in error lines; the token has its place."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return None  # refused as no http(s) URL, or by the connection
    if user is None and password is None:
        return None
    shown = url.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)
    return (
        f"{shown}: credentials do not belong in Label Studio's URL (it is pinned into the compiled pipeline and "
        f"printed); the token goes in LABEL_STUDIO_API_KEY (on a cluster, the Secret feedback.token_secret)"
    )
