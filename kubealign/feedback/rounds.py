"""Rounds of the feedback loop: a round is one pipeline run (pull -> data-split with people's rows -> ... -> serve
the canary -> judge -> act), and the next round starts from the last one's outputs. The bookkeeping, from a
`kubealign run` output's run.json: the next round's config (the last one's, feedback.round plus one,
feedback.previous_run its MLflow pipeline run: tags on every MLflow run of the new round, so that the lineage walks
back round by round), and the judge output whose served pairs the last round pushes to people.

On a schedule (a KFP recurring run) every run starts from the same compiled config: there the feedback task counts
the round from the project itself (`counted`): one after the last round whose served pairs were pushed to people,
never below the configured one, and previous_run the judge run that served those pairs. The rest of the run reads
that config (the task's output), so its MLflow runs and the pairs it pushes carry the counted round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

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


class LastRound(NamedTuple):
    round: int  # the highest meta.kubealign.round among the project's tasks
    judge_run: str | None  # the judge run that served that round's pairs (None: not recorded)


def last_pushed(tasks: list[dict[str, Any]]) -> LastRound | None:
    """The last round whose served pairs are in the project (decided or not); None when none was pushed from what
    was served. Tasks as feedback.export.checked passed them."""
    metas = [task["meta"]["kubealign"] for task in tasks]
    found = [m for m in metas if isinstance(m.get("round"), int) and not isinstance(m["round"], bool)]
    if not found:
        return None
    last = max(meta["round"] for meta in found)
    runs = sorted({str(m["judge_run"]) for m in found if m["round"] == last and m.get("judge_run")})
    return LastRound(last, runs[0] if len(runs) == 1 else None)


def counted(config: KubealignConfig, pushed: LastRound | None) -> KubealignConfig:
    """`config` with feedback.round one after the last pushed round where that is above the configured round, and
    feedback.previous_run that round's judge run (module docstring); unchanged otherwise."""
    if pushed is None or pushed.round + 1 <= config.feedback.round:
        return config
    feedback = config.feedback.model_copy(update={"round": pushed.round + 1, "previous_run": pushed.judge_run})
    return config.model_copy(update={"feedback": feedback})


def served_dir(index: dict[str, Any], run: Path) -> Path:
    """The round's judge output (what the canary served), from which its pairs go to people."""
    entry = index.get("stages", {}).get(JUDGE)
    if not entry:
        raise UserError(
            f"{run / 'run.json'}: no {JUDGE} task: nothing was served to push (serve.enabled with promote.mode canary "
            "judges the canary online; or push from a `kubealign judge` output: feedback push --from-judge)"
        )
    return Path(entry["dir"])
