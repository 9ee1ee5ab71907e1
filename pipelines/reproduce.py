"""`kubealign reproduce NAME VERSION`: a registered version made again from its recipe, and compared.

The version's provenance manifest (kubealign.provenance.manifest, written by promote) holds the resolved config
and the digest of every data source and weight file. The rerun refuses in one line when a source's content
changed since (the same config on other data is another recipe), then runs the whole DAG through kfp.local as
`kubealign run` does, into its own output directory and its own MLflow store there (the registry the version
came from is only read: nothing is registered in it), and compares the weight files the candidate's training
task made against the manifest's digests: identical on CPU for the tiny presets; otherwise the largest
parameter difference (against the registered files, downloaded) and the evaluation figures side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from kubealign.config import KubealignConfig, config_from_json
from kubealign.errors import UserError
from kubealign.pipelines.local import run, scoped_environ
from kubealign.provenance import compare, manifest
from kubealign.provenance.digests import file_digests
from kubealign.shape import route_task
from kubealign.tracking.runs import PARENT_RUN_ENV

# The rerun's own store: none of the environment's tracking settings may reach it.
TRACKING_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
    PARENT_RUN_ENV,
)
# what the rerun leaves out: serving, the online judge and its acts touch a cluster and make no weights
OVERRIDES = ["tracking.uri=null", "serve.enabled=false"]
FIGURES = ("win_rate", "reward_gain", "kl_to_baseline", "candidate_reward_mean", "heldout_win_rate")


def recipe(name: str, version: str, tracking_uri: str) -> tuple[Any, dict[str, Any]]:
    """(the model version, its manifest); one line when either is not there."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors

    with registry_errors(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        try:
            found = client.get_model_version(name, version)
        except Exception as exc:
            if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise UserError(f"reproduce: {name} has no version {version} in {tracking_uri}") from None
            raise
        recorded = manifest.read(found.source, tracking_uri)
    if recorded is None:
        raise UserError(
            f"reproduce: {name} version {version} has no {manifest.MANIFEST_FILE} (registered without a provenance "
            "manifest): there is no recipe to remake it from"
        )
    return found, recorded


def check_sources(config: KubealignConfig, recorded: dict[str, Any], what: str) -> None:
    """Every configured data source reads as it did when the version was made (its content digest)."""
    from kubealign.data.sources import read_source

    then = {s["path"]: s["sha256"] for s in (recorded.get("data") or {}).get("sources", [])}
    for index, source in enumerate(config.data.sources):
        now = read_source(index, source, config.data)
        if now.label not in then:
            raise UserError(f"reproduce: data.sources[{index}] {now.label}: {what} was not made from this source")
        if now.sha256 != then[now.label]:
            raise UserError(
                f"reproduce: data.sources[{index}] {now.label} changed since {what} was made (sha256 "
                f"{then[now.label][:12]}… then, {now.sha256[:12]}… now): this is another recipe"
            )


def candidate_dirs(index: dict[str, Any], recorded: dict[str, Any], candidate: str | None) -> tuple[Path, Path]:
    """(the candidate's model dir, its evaluation dir) in the rerun's index: named after the candidate in a
    several-candidate run, else the route's training task and `evaluate`."""
    stages = index["stages"]
    if candidate and candidate in stages:
        return Path(stages[candidate]["dir"]), Path(stages[f"evaluate-{candidate}"]["dir"])
    task = route_task(recorded["training"].get("algorithm") or index.get("algorithm") or "ppo")
    return Path(stages[task]["dir"]), Path(stages["evaluate"]["dir"])


def reproduce(name: str, version: str, tracking_uri: str, output: Path, stream: TextIO | None = None) -> dict[str, Any]:
    """Rerun the version's recipe into OUTPUT and compare; the report (also OUTPUT/reproduce.json)."""
    found, recorded = recipe(name, version, tracking_uri)
    what = f"{name} version {version}"
    config = config_from_json(json.dumps(recorded["config"]), OVERRIDES)
    check_sources(config, recorded, what)
    with scoped_environ(dict.fromkeys(TRACKING_ENV)):
        index = run(config, output, stream=stream)
    model_dir, evaluation = candidate_dirs(index, recorded, (found.tags or {}).get("kubealign.candidate"))
    made = file_digests(model_dir)
    weights = compare.compare_weights(made, recorded["files"])
    report: dict[str, Any] = {
        "registered_model": name,
        "version": str(version),
        "identical": not (weights.different or weights.missing or weights.extra) and bool(weights.identical),
        "weights": weights._asdict(),
        "model_dir": str(model_dir),
        "data_cache_key": {"registered": (recorded.get("data") or {}).get("cache_key"), "remade": _cache_key(index)},
    }
    metrics = json.loads((evaluation / "result.json").read_text(encoding="utf-8"))["metrics"]
    report["figures"] = compare.figures_side_by_side(recorded.get("evaluation") or {}, metrics, FIGURES)
    if not report["identical"]:
        report["difference"] = _against_registered(found, tracking_uri, model_dir)
    (output / "reproduce.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


def _cache_key(index: dict[str, Any]) -> str | None:
    try:
        data_dir = Path(index["stages"]["data-split"]["dir"])
        return json.loads((data_dir / "manifest.json").read_text(encoding="utf-8")).get("cache_key")
    except (KeyError, OSError, json.JSONDecodeError):
        return None


def _against_registered(found: Any, tracking_uri: str, model_dir: Path) -> dict[str, Any]:
    """The largest parameter difference between the remade weights and the registered ones (downloaded)."""
    import tempfile

    import mlflow.artifacts

    from kubealign.serving import location

    served = location.served_version(found, found.name, "", tracking_uri)
    with tempfile.TemporaryDirectory(prefix="kubealign-reproduce-") as tmp:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=served.model_dir_uri, dst_path=tmp, tracking_uri=tracking_uri
        )
        return compare.largest_difference(model_dir, Path(local))


def lines(report: dict[str, Any]) -> list[str]:
    """The report as a person reads it."""
    what = f"{report['registered_model']} version {report['version']}"
    weights = report["weights"]
    if report["identical"]:
        head = (
            f"reproduced {what}: {len(weights['identical'])} weight files identical ({', '.join(weights['identical'])})"
        )
    else:
        diff = report["difference"]
        head = (
            f"NOT reproduced {what} bit for bit: {len(weights['different'])} weight files differ "
            f"({', '.join(weights['different'] + weights['missing'] + weights['extra'])}); largest parameter "
            f"difference {diff['max_abs_diff']:.3g} ({diff['tensor']})"
        )
    keys = report["data_cache_key"]
    data = (
        "same data (cache key " + str(keys["registered"])[:12] + "…)"
        if keys["registered"] == keys["remade"]
        else (f"data differ: cache key {str(keys['registered'])[:12]}… registered, {str(keys['remade'])[:12]}… remade")
    )
    return [head, data, *report["figures"], f"remade model: {report['model_dir']}"]
