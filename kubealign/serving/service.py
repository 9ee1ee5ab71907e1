"""The InferenceService of a registry alias, from the registry: the alias resolved to its version
(kubealign.serving.location), the version's files listed and checked, the chat template an OpenAI-server
runtime needs read from its tokenizer, then the pure manifest (kubealign.serving.manifest); written whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubealign.config.serve import ServeConfig
from kubealign.serving.runtimes import runtime


@dataclass(frozen=True)
class Canary:
    """Another alias of the same registered model, served beside the stable one with `percent` of the traffic
    (`kubealign serve --canary`, and the serve task for promote.mode canary's challenger)."""

    alias: str
    percent: int


def manifest_for(
    cfg: ServeConfig,
    tracking_uri: str,
    registered_model: str,
    namespace: str,
    accelerator: str = "nvidia.com/gpu",
    canary: Canary | None = None,
) -> dict[str, Any]:
    """The InferenceService for `cfg.alias` of `registered_model` in the registry at tracking_uri: the alias
    resolved to its version, the version's HF directory listed and checked, its URI made one KServe reads.
    canary: another alias served beside it as the canary, at its traffic share (manifest.with_canary)."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors
    from kubealign.serving import location, manifest

    with registry_errors(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        served = location.resolve(client, registered_model, cfg.alias, tracking_uri)
        names = location.check_listing(served, tracking_uri)
        recorded = location.recorded_files(served, tracking_uri)
        location.check_remote(served, tracking_uri, recorded)
        template = chat_template(served, names, tracking_uri) if runtime(cfg.runtime).openai_server else None
    storage = location.storage_uri(served.model_dir_uri, cfg.artifacts_destination)
    body = manifest.inference_service(served, storage, cfg, namespace, accelerator, template)
    body = manifest.with_digest(body, recorded["model_sha256"], recorded["files"])
    if canary is None:
        return body
    theirs = manifest_for(
        cfg.model_copy(update={"alias": canary.alias}), tracking_uri, registered_model, namespace, accelerator
    )
    return manifest.with_canary(body, theirs, canary.percent)


def chat_template(served: Any, names: list[str], tracking_uri: str) -> str | None:
    """The template an OpenAI-server runtime's chat route needs for this version (kubealign.serving.chat), from
    its tokenizer's files alone (the weights are not downloaded)."""
    import posixpath
    import tempfile

    import mlflow.artifacts
    from transformers import AutoTokenizer

    from kubealign.errors import UserError, first_line
    from kubealign.serving.chat import template_for

    with tempfile.TemporaryDirectory(prefix="kubealign-tokenizer-") as tmp:
        for name in names:
            if not name.endswith((".safetensors", ".bin", ".pt")):
                uri = posixpath.join(served.model_dir_uri, name)
                mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp, tracking_uri=tracking_uri)
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        except Exception as exc:  # transformers raises many kinds for a broken tokenizer
            where = f"{served.name} version {served.version}"
            raise UserError(f"serve: {where}: its tokenizer does not load ({first_line(exc)})") from None
    return template_for(tokenizer)


def write_manifest(body: dict[str, Any], path: Path) -> None:
    """The manifest as YAML, whole or not at all."""
    import yaml

    from kubealign.errors import UserError

    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise UserError(f"--manifest {path}: {exc.strerror}") from None
