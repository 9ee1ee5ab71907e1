"""The push stage (the pipeline's `push` task, after judge and act): the pairs the round's canary served, as the
judge task wrote them (answers.json: both versions' answers to the same prompts), pushed to the Label Studio project
feedback.project as pairwise tasks for people: up to feedback.budget of them, the pairs where the judges disagree most
first, feedback.random_share at random (kubealign.feedback.served). It closes the loop on a cluster: the next round's
feedback task pulls what people chose. Label Studio and the token as the feedback task finds them ($LABEL_STUDIO_URL
pinned when the pipeline is compiled, $LABEL_STUDIO_API_KEY from feedback.token_secret); no user code runs here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, write_result

STAGE = "push"


def run(config: KubealignConfig, judgement: Path, output: Path) -> dict[str, Any]:
    from kubealign.feedback.client import URL_ENV, connect
    from kubealign.feedback.served import push_round

    settings = config.feedback
    if settings.project is None:
        raise UserError("feedback.project: not set; name the Label Studio project the served pairs go to")
    check_output_path(output, STAGE)
    client = connect(os.environ.get(URL_ENV) or settings.url, settings)
    done, got, lines = push_round(client, settings.project, judgement, config, config.promote.registered_model)
    print("\n".join(lines))
    metrics = {
        "tasks_added": done.added,
        "tasks_present": done.present,
        "pairs_served": got.served,
        "pairs_alike": got.identical,
        "round": settings.round,
    }
    with atomic_dir(output) as tmp:
        result = write_result(
            tmp, STAGE, metrics, {}, project=settings.project, url=client.url, judge_run=got.judge_run
        )
    return {**result, "output": str(output)}
