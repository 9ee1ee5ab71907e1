"""Rounds of the feedback loop: a round is one pipeline run (pull -> data-split with people's rows -> ... -> serve
the canary -> judge -> act), and the next round starts from the last one's outputs. The bookkeeping, from a
`kubealign run` output's run.json: the next round's config (the last one's, feedback.round plus one,
feedback.previous_run its MLflow pipeline run: tags on every MLflow run of the new round, so that the lineage walks
back round by round), and the judge output whose served pairs the last round pushes to people.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_from_json, config_to_json
from kubealign.errors import UserError
from kubealign.shape import JUDGE


def last_round(index: dict[str, Any], run: Path) -> KubealignConfig:
    """The config a finished round ran with (run.json's config_json); one line when it is not a round's run."""
    where = run / "run.json"
    if "config_json" not in index:
        raise UserError(f"{where}: no config_json; was it written by `kubealign run`?")
    if not index.get("succeeded"):
        raise UserError(f"{where}: that run did not succeed: rerun it (kubealign rerun) before the next round")
    config = config_from_json(index["config_json"])
    if config.feedback.project is None:
        raise UserError(f"{where}: feedback.project is not set: a round learns from people's choices in a project")
    return config


def next_config(index: dict[str, Any], run: Path, overrides: list[str]) -> KubealignConfig:
    """The next round's config: the last round's, feedback.round + 1, feedback.previous_run = its MLflow pipeline
    run, then `overrides` (--set)."""
    config = last_round(index, run)
    parent = (index.get("mlflow") or {}).get("parent_run_id")
    if not parent:
        raise UserError(f"{run / 'run.json'}: mlflow.parent_run_id is missing: the next round could not name it")
    feedback = config.feedback.model_copy(update={"round": config.feedback.round + 1, "previous_run": str(parent)})
    # through JSON again: the overrides apply and the whole config is validated, as a run's config_json is
    return config_from_json(config_to_json(config.model_copy(update={"feedback": feedback})), overrides)


def served_dir(index: dict[str, Any], run: Path) -> Path:
    """The round's judge output (what the canary served), from which its pairs go to people."""
    entry = index.get("stages", {}).get(JUDGE)
    if not entry:
        raise UserError(
            f"{run / 'run.json'}: no {JUDGE} task: nothing was served to push (serve.enabled with promote.mode canary "
            "judges the canary online; or push from a `kubealign judge` output: feedback push --from-judge)"
        )
    return Path(entry["dir"])
