"""A canary's verdict held for people (canary.await_people): what the judge records, and what the next run's settle
task (kubealign.stages.settle) reads to finish it.

The judge that waits tags its MLflow run with the judged version, the registered model and the champion it was
compared with; its metrics, which it logs in any case, hold every figure the decision reads. The settle task
runs in the pipeline's next run, after the feedback task pulled people's choices: the verdict is decided again on
those recorded figures with people's win-rate and the judges' latest agreement with them
(kubealign.serving.verdict.decide), without asking the servers again: the same versions still serve, the
champion checked unchanged. Like the act task's verdict.json, the record is what the judge (user code, the
tracking identity) wrote; the settle task reads figures from it, never where to act (that comes from the config).
"""

from __future__ import annotations

from typing import Any

VERSION_TAG = "kubealign.judge.awaiting_version"
MODEL_TAG = "kubealign.judge.registered_model"
CHAMPION_TAG = "kubealign.judge.champion_version"
STAGE_TAG = "kubealign.stage"  # kubealign.tracking.runs tags every stage's run with it
# the figures of each served model the judge logs as "<who>/<figure>" (kubealign.stages.judge), and its own two
SERVED = ("champion/", "canary/")
NOT_ONLINE = ("promoted", "wall_time_s", "awaiting_people")


def tags(registered_model: str, version: str, champion_version: str) -> dict[str, str]:
    """The tags the waiting judge's run carries."""
    return {VERSION_TAG: version, MODEL_TAG: registered_model, CHAMPION_TAG: champion_version}


def recorded(metrics: dict[str, float]) -> tuple[dict[str, float] | None, int, dict[str, float]]:
    """(the online comparison decide() reads, None when no prompt was answered by both; the number of those
    prompts; the canary's serving figures), split from a judge run's logged metrics. The judges' agreement with
    people (agreement_*) is left out: the settle task reads the latest."""
    canary = {key.removeprefix("canary/"): value for key, value in metrics.items() if key.startswith("canary/")}
    online = {
        key: value
        for key, value in metrics.items()
        if not key.startswith(SERVED) and key not in NOT_ONLINE and not key.startswith("agreement_")
    }
    if "prompts" not in online:
        return None, 0, canary
    return online, int(online["prompts"]), canary


def find(client: Any, experiment_id: str, registered_model: str, version: str) -> Any:
    """The newest finished judge run that waits for people on `registered_model`'s `version`; None if none.
    client: an MlflowClient."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{STAGE_TAG}` = 'judge' and tags.`{VERSION_TAG}` = '{version}' "
        f"and tags.`{MODEL_TAG}` = '{registered_model}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None
