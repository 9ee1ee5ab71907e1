"""The feedback stage (the pipeline's `feedback` task): the completed pairwise annotations of the Label
Studio project `feedback.project` pulled into OUTPUT/human.jsonl, the rows data-split then reads as one more
source (weighted by feedback.weight), with a `feedback` MLflow run (kubealign.feedback.pull: the file as its
dataset input, the counts and the human win-rate of `feedback.challenger`). An empty file where nobody has
decided a task yet: data-split then leaves it out. Where tasks pushed from what was served were decided, the
picture across rounds beside it (kubealign.stages.feedback_report: rounds.png, rounds.md). Label Studio:
$LABEL_STUDIO_URL, which the pipeline pins on the task from feedback.url when it is compiled (a run's config_json
cannot send the token elsewhere), else feedback.url; the token in $LABEL_STUDIO_API_KEY (the Secret
feedback.token_secret on the cluster)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_to_json
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, write_result
from kubealign.stages import feedback_report

STAGE = "feedback"
ROWS_FILE = "human.jsonl"


def run(config: KubealignConfig, output: Path) -> dict[str, Any]:
    from kubealign.feedback.client import URL_ENV, connect
    from kubealign.feedback.pull import pull, track
    from kubealign.feedback.rounds import counted
    from kubealign.tracking.runs import resolve_uri

    settings = config.feedback
    if settings.project is None:
        raise UserError("feedback.project: not set; name the Label Studio project whose choices to pull")
    check_output_path(output, STAGE)
    started = time.perf_counter()
    client = connect(os.environ.get(URL_ENV) or settings.url, settings)
    registry = resolve_uri(config)  # where the tasks' models and versions are checked (none: not checked)
    with atomic_dir(output) as tmp:
        written = pull(client, settings.project, settings.challenger, tmp / ROWS_FILE, output / ROWS_FILE, registry)
        config = counted(config, written.pushed)  # on a schedule, the round is the project's (feedback.rounds)
        metrics = {**written.metrics, "wall_time_s": round(time.perf_counter() - started, 3)}
        table = feedback_report.across_rounds(written.metrics)
        drawn = [p.name for p in feedback_report.write(table, tmp)] if table else []
        files = {"rows": ROWS_FILE, **({"picture": drawn[0], "table": drawn[1]} if drawn else {})}
        this = {"round": config.feedback.round, "previous_run": config.feedback.previous_run}
        result = write_result(tmp, STAGE, metrics, files, project=settings.project, url=client.url, **this)
    print("\n".join(written.lines))
    if config.feedback.round != settings.round:
        print(f"  round {config.feedback.round}: counted from the project (round {written.pushed.round} was pushed)")
    if drawn:
        print(f"  across rounds: {output / 'rounds.png'}")
    pictures = [output / name for name in drawn]
    track(config, written, output / ROWS_FILE, settings.project, client.url, settings.challenger, pictures)
    return {**result, "output": str(output), "config_json": config_to_json(config)}


def rows_file(output: Path) -> Path | None:
    """The pulled file of a feedback output, None when it holds no row (nothing decided yet)."""
    path = Path(output) / ROWS_FILE
    return path if path.is_file() and path.stat().st_size else None


def with_rows(config: KubealignConfig, output: Path) -> KubealignConfig:
    """`config` with the pulled rows of the feedback output `output` as one more data source (weight
    feedback.weight); unchanged where the pull holds no row."""
    from kubealign.config import DataSource

    people = rows_file(output)
    if people is None:
        return config
    # phase reward: people were asked about prompts the online judge served, held out of training; their choices
    # train the reward model, and those prompts leave the held-out splits (kubealign.data.split, rule 5)
    people_source = DataSource(path=str(people), weight=config.feedback.weight, phase="reward")
    sources = [*config.data.sources, people_source]
    return config.model_copy(update={"data": config.data.model_copy(update={"sources": sources})})
