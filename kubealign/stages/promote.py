"""Stage 5, promote: register the PPO actor in the MLflow model registry behind a measured gate.

Every promotion registers (once) a version of `promote.registered_model` and points `challenger` at it.
`champion` moves to it only if the gate passes: the configured thresholds (min win-rate over the
baseline, min reward gain, max KL) AND, when a champion exists and `require_beat_champion` is on, a
higher candidate reward than the champion's. The champion it replaces keeps `previous-champion`;
`kubealign rollback` moves `champion` back to it. Promoting the same evaluation of the same model
twice registers nothing new (the version carries a promotion key). A registry failure is a one-line
error, and aliases moved before it are put back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.config import KubealignConfig
from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError, first_line
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.tracking import PARENT_RUN_ENV, stage_run

STAGE = "promote"
CHALLENGER, CHAMPION, PREVIOUS = "challenger", "champion", "previous-champion"
KEY_TAG = "kubealign.promotion_key"
GATED_METRICS = ("win_rate", "reward_gain", "kl_to_baseline", "candidate_reward_mean")
OPTIONAL_METRICS = ("win_rate_lower_bound",)  # gated only when its threshold is set


def gate(metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None) -> tuple[bool, list[str]]:
    """(passed, one line per check) for an evaluation's metrics against the thresholds and the champion."""
    checks = [
        (metrics["win_rate"] >= cfg.min_win_rate, f"win_rate {metrics['win_rate']:.3f} >= {cfg.min_win_rate}"),
        (
            metrics["reward_gain"] >= cfg.min_reward_gain,
            f"reward_gain {metrics['reward_gain']:.3f} >= {cfg.min_reward_gain}",
        ),
    ]
    if cfg.min_win_rate_lower_bound is not None:
        bound = metrics.get("win_rate_lower_bound")
        if bound is None:
            raise UserError("promote.min_win_rate_lower_bound is set but the evaluation has no win_rate_lower_bound")
        checks.append(
            (
                bound >= cfg.min_win_rate_lower_bound,
                f"win_rate_lower_bound {bound:.3f} >= {cfg.min_win_rate_lower_bound}",
            )
        )
    if cfg.max_kl is not None:
        kl = metrics["kl_to_baseline"]
        checks.append((kl <= cfg.max_kl, f"kl_to_baseline {kl:.3f} <= {cfg.max_kl}"))
    if champion is not None and cfg.require_beat_champion:
        ours, theirs = metrics["candidate_reward_mean"], champion["candidate_reward_mean"]
        checks.append((ours > theirs, f"candidate_reward_mean {ours:.3f} > champion's {theirs:.3f}"))
    return all(ok for ok, _ in checks), [("pass: " if ok else "FAIL: ") + text for ok, text in checks]


@contextlib.contextmanager
def registry_errors(uri: str) -> Iterator[None]:
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise UserError(f"MLflow registry at {uri}: {first_line(exc)}") from None


def alias_version(client: Any, name: str, alias: str) -> Any:
    """The model version an alias points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def promotion_key(evaluation: Path, model_dir: Path) -> str:
    digest = hashlib.sha256((evaluation / "result.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(hashlib.sha256(weights.read_bytes()).digest())
    return digest.hexdigest()


def register(client: Any, run_id: str, name: str, model_dir: Path, key: str, tags: dict[str, str]) -> Any:
    """The version holding this promotion key, registering a new pyfunc model version if there is none.
    Only MlflowClient calls: the fluent API would leave a process-wide tracking/registry URI behind."""
    import tempfile

    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    from kubealign.registry import INPUT_EXAMPLE, MODEL_CODE

    if client.search_registered_models(f"name = '{name}'"):
        for version in client.search_model_versions(f"name = '{name}'"):
            if version.tags.get(KEY_TAG) == key:
                return version
    else:
        with contextlib.suppress(MlflowException):  # created concurrently by another promotion
            client.create_registered_model(name)
    with tempfile.TemporaryDirectory() as tmp:
        # From code, not a pickled object; the signature comes from predict's type hints plus the
        # example's params. MLflow runs predict on the example once: a smoke test of what is registered.
        code = Path(tmp) / "actor_model.py"
        code.write_text(MODEL_CODE, encoding="utf-8")
        mlflow.pyfunc.save_model(
            path=Path(tmp) / "model",
            python_model=str(code),
            artifacts={"model_dir": str(model_dir)},
            input_example=INPUT_EXAMPLE,
            pip_requirements=[f"kubealign=={__version__}"],
        )
        client.log_artifacts(run_id, str(Path(tmp) / "model"), "model")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    return client.create_model_version(name, source=source, run_id=run_id, tags={KEY_TAG: key, **tags})


def move_aliases(client: Any, name: str, version: str, champion: Any, passed: bool) -> None:
    """challenger -> version; if passed: previous-champion -> old champion, champion -> version.
    On a failure midway, the aliases already moved are restored."""
    before = {alias: alias_version(client, name, alias) for alias in (CHALLENGER, PREVIOUS)}
    try:
        client.set_registered_model_alias(name, CHALLENGER, version)
        if passed and (champion is None or str(champion.version) != str(version)):
            if champion is not None:
                client.set_registered_model_alias(name, PREVIOUS, champion.version)
            client.set_registered_model_alias(name, CHAMPION, version)
    except Exception:
        for alias, old in before.items():
            with contextlib.suppress(Exception):
                if old is None:
                    client.delete_registered_model_alias(name, alias)
                else:
                    client.set_registered_model_alias(name, alias, old.version)
        raise


def run(config: KubealignConfig, evaluation: Path, model_dir: Path, output: Path) -> dict[str, Any]:
    cfg = config.promote
    started = time.perf_counter()
    check_output_path(output)
    result = read_result(evaluation)
    if result.get("stage") != "evaluate":
        raise UserError(f"--evaluation {evaluation}: result.json is from stage {result.get('stage')!r}, not evaluate")
    metrics = result["metrics"]
    missing = [m for m in GATED_METRICS if m not in metrics]
    if missing:
        raise UserError(f"--evaluation {evaluation}: result.json lacks metrics {missing}")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {model_dir}: not a model directory (no config.json)")
    if not config.tracking.enabled:
        raise UserError("tracking.enabled is false: promotion needs the MLflow registry")
    from mlflow.tracking import MlflowClient

    key = promotion_key(evaluation, model_dir)
    with stage_run(STAGE, config, output.resolve().parent) as tracker, registry_errors(tracker.tracking_uri):
        client, name = MlflowClient(tracker.tracking_uri), cfg.registered_model
        tags = {f"kubealign.metric.{m}": str(metrics[m]) for m in (*GATED_METRICS, *OPTIONAL_METRICS) if m in metrics}
        tags.update({"kubealign.code_version": __version__, "kubealign.evaluation": str(evaluation.resolve())})
        tags["kubealign.pipeline_run_id"] = os.environ.get(PARENT_RUN_ENV) or os.environ.get("MLFLOW_RUN_ID", "")
        tags["kubealign.data_sha256"] = data_hash(result)
        version = register(client, tracker.run_id, name, model_dir, key, tags)
        champion = alias_version(client, name, CHAMPION)
        champion_metrics = None
        if champion is not None and str(champion.version) != str(version.version):
            champion_metrics = {m: float(champion.tags.get(f"kubealign.metric.{m}", "nan")) for m in GATED_METRICS}
        passed, checks = gate(metrics, cfg, champion_metrics)
        move_aliases(client, name, version.version, champion, passed)
        found = {a: alias_version(client, name, a) for a in (CHALLENGER, CHAMPION, PREVIOUS)}
        aliases = {a: None if v is None else int(v.version) for a, v in found.items()}  # str over REST, int on sqlite
        summary = {"gate_passed": float(passed), "version": float(version.version)}
        summary["wall_time_s"] = time.perf_counter() - started
        tracker.log_metrics(summary)
        with atomic_dir(output) as tmp:
            payload = write_result(
                tmp, STAGE, summary, {}, registered_model=name, version=int(version.version), aliases=aliases,
                gate=checks, model_uri=f"models:/{name}/{version.version}",
            )  # fmt: skip
    return {**payload, "output": str(output)}


def data_hash(evaluation_result: dict[str, Any]) -> str:
    """The data-split cache key of the prompts the evaluation used, when its manifest is at hand."""
    prompts = evaluation_result.get("models", {}).get("prompts")
    try:
        return json.loads((Path(prompts) / "manifest.json").read_text(encoding="utf-8"))["cache_key"]
    except (TypeError, OSError, KeyError, json.JSONDecodeError):
        return ""


def rollback(config: KubealignConfig) -> dict[str, Any]:
    """champion -> previous-champion (which is then cleared); returns the new alias state."""
    from mlflow.tracking import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.tracking.uri
    if not uri:
        raise UserError("rollback: set MLFLOW_TRACKING_URI (or tracking.uri) to the registry to roll back in")
    name = config.promote.registered_model
    with registry_errors(uri):
        client = MlflowClient(uri)
        previous = alias_version(client, name, PREVIOUS)
        if previous is None:
            raise UserError(f"rollback: {name} has no {PREVIOUS} alias to roll back to")
        current = alias_version(client, name, CHAMPION)
        client.set_registered_model_alias(name, CHAMPION, previous.version)
        client.delete_registered_model_alias(name, PREVIOUS)
    return {"champion": previous.version, "rolled_back_from": getattr(current, "version", None)}
