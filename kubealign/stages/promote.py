"""Stage 5, promote: register the candidate in the MLflow model registry behind a measured gate.

Every promotion registers (once) a version of `promote.registered_model` and points `challenger` at it.
`champion` moves to it only if the gate passes (kubealign.promotion.gate): the configured thresholds (min
win-rate over the baseline, min reward gain, max KL), the guards the trained-against reward model cannot
fool (promote.guards: held-out capability, the held-out reward model, no degeneration) AND, when a champion exists and
`require_beat_champion` is on, a higher candidate reward than the champion's. A refusal is one line
(result.json "refusal") naming every failed check. The champion it replaces
keeps `previous-champion`; `kubealign rollback` moves `champion` back to it.

Under the registry lease (kubealign.promotion.lease) a promotion finds or registers its version
(kubealign.promotion.versions), reads the champion, gates and moves the aliases in a journaled order
(kubealign.promotion.aliases): at every point the old champion is still `champion` or already
`previous-champion`, never unreachable, and any registry failure is exit code 2 before or after a
complete, read-back undo.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.config import KubealignConfig
from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.promotion import guards
from kubealign.promotion.aliases import (
    ALIASES,
    CHAMPION,
    PREVIOUS,
    REGISTRY_HTTP,
    error_code,
    move_aliases,
    promotion_plan,
    read_state,
    recover,
    registry_errors,
)
from kubealign.promotion.gate import GATED_METRICS, OPTIONAL_METRICS, gate
from kubealign.promotion.lease import lease
from kubealign.promotion.versions import find_version, manifest_check, promotion_key, register_version, upload_model
from kubealign.provenance import manifest
from kubealign.provenance.digests import file_digests
from kubealign.selection.ranking import standing_name
from kubealign.tracking.runs import PARENT_RUN_ENV, http_settings, resolve_uri, stage_run

STAGE = "promote"
WHEN = {  # when evaluate writes a guard's figure, for the line that says an evaluation lacks it
    "max_logprob_drop": " when the prompts hold phase1_sft",
    "min_heldout_win_rate": " when the reward model dir holds heldout/: data.heldout_reward_fraction > 0",
}


def run(
    config: KubealignConfig,
    evaluation: Path,
    model_dir: Path,
    output: Path,
    comparison: Path | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """comparison: the compare stage's output when the run trained several candidates; this one (`name`, by
    default its route's) is then registered tagged with its name, settings and rank, and only the leader goes
    through the gate to the aliases."""
    cfg = config.promote
    started = time.perf_counter()
    check_output_path(output, STAGE)
    result = read_result(evaluation)
    if result.get("stage") != "evaluate":
        raise UserError(f"--evaluation {evaluation}: result.json is from stage {result.get('stage')!r}, not evaluate")
    metrics = result["metrics"]
    missing = [m for m in GATED_METRICS if m not in metrics]
    if missing:
        raise UserError(f"--evaluation {evaluation}: result.json lacks metrics {missing}")
    lacking = guards.missing(metrics, cfg.guards)
    if lacking:
        field, names = next(iter(lacking.items()))
        raise UserError(
            f"--evaluation {evaluation}: result.json lacks {', '.join(names)}, which promote.guards.{field} checks "
            f"(evaluate writes it{WHEN.get(field, '')}); "
            f"evaluate again, or set promote.guards.{field}: null to promote without this guard"
        )
    gate(metrics, cfg, None)  # an evaluation the gate cannot judge is refused before the registry is touched
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {model_dir}: not a model directory (no config.json)")
    if not config.tracking.enabled:
        raise UserError("tracking.enabled is false: promotion needs the MLflow registry")
    recorded = [
        *GATED_METRICS,
        *OPTIONAL_METRICS,
        *guards.recorded(metrics),
        *(m for m in metrics if m.startswith("fn/")),
    ]
    tags = {f"kubealign.metric.{m}": str(metrics[m]) for m in recorded if m in metrics}
    tags.update({"kubealign.code_version": __version__, "kubealign.evaluation": str(evaluation.resolve())})
    tags["kubealign.pipeline_run_id"] = os.environ.get(PARENT_RUN_ENV) or os.environ.get("MLFLOW_RUN_ID", "")
    tags["kubealign.data_sha256"] = data_hash(result)
    tags["kubealign.algorithm"] = candidate_algorithm(model_dir)
    standing = ranked(comparison, name or tags["kubealign.algorithm"]) if comparison is not None else None
    if standing is not None:
        tags.update({"kubealign.rank": str(standing["rank"]), "kubealign.leader": standing["leader"] or ""})
        tags.update({"kubealign.candidate": standing["candidate"], "kubealign.settings": standing["settings"]})
    recipe = provenance(config, model_dir, result, metrics, {"pipeline_run_id": tags["kubealign.pipeline_run_id"]})
    tags.update(manifest.tags(recipe))
    key = promotion_key(evaluation, model_dir)
    error: BaseException | None = None
    run_name = STAGE if standing is None else f"{STAGE}-{standing['candidate']}"
    try:
        with http_settings(REGISTRY_HTTP), stage_run(run_name, config, output.resolve().parent) as tracker:
            try:
                with registry_errors(tracker.tracking_uri):
                    leads = standing is None or standing["leader"] == standing["candidate"]
                    summary, details = promote_in_registry(tracker, cfg, metrics, (model_dir, recipe), key, tags, leads)
                    if standing is not None:
                        summary["rank"] = float(standing["rank"])
                        details["comparison"] = standing
                    summary["wall_time_s"] = time.perf_counter() - started
                    tracker.log_metrics(summary)
                with atomic_dir(output) as tmp:
                    payload = write_result(tmp, STAGE, summary, {}, **details)
            except BaseException as exc:
                error = exc
                raise
    except Exception:
        if error is not None:  # ending the run against a dead server must not hide why the stage failed
            raise error from None
        raise
    return {**payload, "output": str(output)}


def promote_in_registry(
    tracker: Any,
    cfg: PromoteConfig,
    metrics: dict[str, float],
    candidate: tuple[Path, dict[str, Any]],
    key: str,
    tags: dict[str, str],
    leads: bool = True,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Register (once) and gate the candidate (its HF directory and provenance manifest), move the aliases;
    (summary metrics, result.json fields). leads False (a route the comparison did not rank first): registered
    and gated, but no alias moves."""
    from mlflow.tracking import MlflowClient

    client, uri, name = MlflowClient(tracker.tracking_uri), tracker.tracking_uri, cfg.registered_model
    try:
        client.create_registered_model(name)
    except Exception as exc:
        if error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
    # The upload (slow, into this run's own artifacts) happens outside the lease; registering is inside.
    model_dir, recipe = candidate
    source = None if find_version(client, name, key) else upload_model(client, tracker.run_id, model_dir, recipe)
    with lease(client, uri, name):
        aliases = recover(client, uri, name)
        version = find_version(client, name, key)
        if version is None:
            source = source or upload_model(client, tracker.run_id, model_dir, recipe)
            version = register_version(client, name, source, tracker.run_id, key, tags)
        elif "kubealign.rank" in tags:  # a rerun of the comparison may have ranked a known version anew
            for tag in ("kubealign.rank", "kubealign.leader"):
                client.set_model_version_tag(name, version.version, tag, tags[tag])
        ours, champion = str(version.version), aliases.get(CHAMPION)
        champion_metrics = None
        if champion is not None and champion != ours:
            theirs = client.get_model_version(name, champion).tags
            wanted = [*GATED_METRICS, *([cfg.metric] if cfg.metric != "win_rate" else [])]
            champion_metrics = {m: float(theirs.get(f"kubealign.metric.{m}", "nan")) for m in wanted}
        if cfg.guards.min_judge_agreement is not None:  # the judges checked against people (latest feedback pull)
            from kubealign.feedback.lookup import agreement

            found = agreement(client, client.get_run(tracker.run_id).info.experiment_id, name)
            # a reward model checked on people's kept-out pairs (evaluate's agreement_*: feedback.fresh) has its own
            metrics = {**found, **metrics}
        passed, checks = gate(metrics, cfg, champion_metrics)
        proven, line = manifest_check(version, version.source, uri)  # a version that cannot be verified or remade
        passed, checks = passed and proven, [*checks, ("pass: " if proven else "FAIL: ") + line]
        plan = promotion_plan(cfg.mode, leads, passed, ours, champion)
        move_aliases(client, uri, name, aliases, plan)
        after, _ = read_state(client, name)
    summary = {"gate_passed": float(passed), "version": float(ours)}
    details = {
        "registered_model": name,
        "version": int(ours),
        "aliases": {a: None if after.get(a) is None else int(after[a]) for a in ALIASES},
        "aliases_before": {a: None if aliases.get(a) is None else int(aliases[a]) for a in ALIASES},
        "gate": checks,
        "refusal": guards.refusal(checks, metrics),  # "" when it passed
        "mode": cfg.mode,
        "model_uri": f"models:/{name}/{ours}",
        "model_sha256": recipe["model_sha256"],
    }
    return summary, details


def ranked(comparison: Path, candidate: str) -> dict[str, Any]:
    """This candidate's place in the compare stage's result (`candidate`: its name): rank, leader (None when no
    candidate kept pipeline.max_kl), why it is not first, its settings; plus every other candidate's place, so
    that each promotion says which won and why the others did not."""
    result = read_result(comparison)
    if result.get("stage") != "compare":
        raise UserError(f"--comparison {comparison}: result.json is from stage {result.get('stage')!r}, not compare")
    standings = {standing_name(s): s for s in result["standings"]}
    if candidate not in standings:
        ranked_names = ", ".join(standings) or "none"
        raise UserError(f"--comparison {comparison}: the candidate {candidate} is not ranked there ({ranked_names})")
    ours, leader = standings[candidate], result["leader"]
    others = {
        standing_name(s): f"rank {s['rank']}: {s['why']}" for s in result["standings"] if standing_name(s) != leader
    }
    others.pop(candidate, None)
    others.update({failed: "failed: not ranked" for failed in result.get("failed", [])})
    if leader is None:
        verdict = result["verdict"]
    else:
        verdict = "the leader" if leader == candidate else f"not the leader (rank {ours['rank']}): {ours['why']}"
    listed = {c["name"]: c.get("set") or {} for c in result.get("candidates", [])}
    return {
        "candidate": candidate,
        "rank": ours["rank"],
        "leader": leader,
        "verdict": verdict,
        "others": others,
        "settings": json.dumps(listed.get(candidate, {}), sort_keys=True),
    }


def candidate_algorithm(model_dir: Path) -> str:
    """How the candidate was trained (ppo, grpo, rloo, dpo), from the result.json its stage wrote: the
    registry compares versions made by every route with one gate, and this tag says which is which."""
    try:
        produced = json.loads((model_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "unknown"
    if produced.get("stage") == "ppo":
        return str(produced.get("algorithm") or "ppo")
    return str(produced.get("stage") or "unknown")


def provenance(
    config: KubealignConfig, model_dir: Path, evaluation: dict[str, Any], metrics: dict[str, float], runs: dict
) -> dict[str, Any]:
    """The version's manifest (kubealign.provenance.manifest): the candidate's files and how they were made,
    from the training stage's result.json, the data-split manifest of the evaluated prompts, the config."""
    from kubealign.config import config_to_json

    try:
        trained = json.loads((model_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        trained = {}
    data = data_manifest(evaluation)
    resolved = json.loads(config_to_json(config))
    files = file_digests(model_dir)
    return manifest.build(resolved, files, manifest.training_record(trained), data, metrics, runs)


def data_manifest(evaluation_result: dict[str, Any]) -> dict[str, Any] | None:
    """The data-split manifest of the prompts the evaluation used, when it is at hand."""
    prompts = evaluation_result.get("models", {}).get("prompts")
    try:
        return json.loads((Path(prompts) / "manifest.json").read_text(encoding="utf-8"))
    except (TypeError, OSError, json.JSONDecodeError):
        return None


def data_hash(evaluation_result: dict[str, Any]) -> str:
    """The data-split cache key of the prompts the evaluation used, when its manifest is at hand."""
    return str((data_manifest(evaluation_result) or {}).get("cache_key") or "")


def rollback(config: KubealignConfig) -> dict[str, Any]:
    """champion -> previous-champion (which is then cleared), under the lease and the journal; returns
    the new alias state. Fails closed like promote: an unreadable alias is an error, not an absent one."""
    from mlflow.tracking import MlflowClient

    uri = resolve_uri(config)  # refuses credentials in the URI, like every stage
    if not uri:
        raise UserError("rollback: set MLFLOW_TRACKING_URI (or tracking.uri) to the registry to roll back in")
    name = config.promote.registered_model
    with http_settings(REGISTRY_HTTP), registry_errors(uri):
        client = MlflowClient(uri)
        with lease(client, uri, name):
            aliases = recover(client, uri, name)
            previous, current = aliases.get(PREVIOUS), aliases.get(CHAMPION)
            if previous is None:
                raise UserError(f"rollback: {name} has no {PREVIOUS} alias to roll back to")
            move_aliases(client, uri, name, aliases, [(CHAMPION, previous), (PREVIOUS, None)])
    return {"champion": previous, "rolled_back_from": current}
