"""Where the served bytes are: the registered version's Hugging Face directory, as a URI KServe can read.

promote logs the actor as a pyfunc whose artifact `model_dir` is the HF directory that `evaluate` scored
(kubealign.promotion.versions). Its path inside the logged model is in the model's MLmodel file
(flavors.python_function.artifacts.model_dir.path), so the served directory is SOURCE/PATH, the very bytes
the registry holds; nothing is copied. A server started with --serve-artifacts hands out
`mlflow-artifacts:/X` URIs, which only MLflow's own client understands: KServe's storage initializer reads
s3://, gs://, pvc:// (and hf://), so X is resolved against the server's --artifacts-destination
(serve.artifacts_destination).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kubealign.errors import UserError

READABLE = ("s3://", "gs://", "pvc://")
# A Hugging Face model directory as vLLM and transformers load it: any of each group.
NEEDED = {
    "config.json": ("config.json",),
    "weights (*.safetensors)": (".safetensors",),
    "a tokenizer": ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"),
}


@dataclass(frozen=True)
class Served:
    """What an alias names: the registered model, its version and alias, the run that registered it, and
    the HF directory's artifact URI as the registry gives it."""

    name: str
    version: str
    alias: str
    run_id: str
    model_dir_uri: str
    source: str = ""  # the version's source: its MLmodel and provenance.json are there


def storage_uri(uri: str, artifacts_destination: str | None) -> str:
    """The URI KServe's storage initializer reads for an artifact URI of the registry."""
    if uri.startswith(READABLE):
        return uri
    if uri.startswith("mlflow-artifacts:"):
        if not artifacts_destination:
            raise UserError(
                f"serve.artifacts_destination: the registry serves its artifacts ({uri}); give the server's "
                "--artifacts-destination (s3://... or pvc://...) so that KServe can read them"
            )
        # mlflow-artifacts:/1/abc/artifacts/model or mlflow-artifacts://host:port/1/abc/...: the path is the
        # artifact's place below the destination
        rest = uri.removeprefix("mlflow-artifacts:")
        if rest.startswith("//"):
            rest = rest[2:].partition("/")[2]
        return f"{artifacts_destination.rstrip('/')}/{rest.lstrip('/')}"
    raise UserError(
        f"serve: the model's files are at {uri}, which KServe cannot read (it reads s3://, gs://, pvc://): "
        "serve from a registry whose artifacts are in object storage or on a PVC"
    )


def missing_files(names: Iterable[str]) -> list[str]:
    """What a HF directory listing lacks, by NEEDED's groups (empty when it is complete)."""
    names = list(names)
    return [what for what, any_of in NEEDED.items() if not any(n == a or n.endswith(a) for n in names for a in any_of)]


def resolve(client: Any, name: str, alias: str, tracking_uri: str) -> Served:
    """The version `alias` names and its HF directory's URI; one line when the model, the alias or the
    directory is not there."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if getattr(exc, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise UserError(f"serve: registered model {name!r} has no alias {alias!r}") from None
        raise
    return served_version(version, name, alias, tracking_uri)


def served_version(version: Any, name: str, alias: str, tracking_uri: str) -> Served:
    """A model version (MlflowClient's) as Served: its HF directory's URI, from its MLmodel."""
    source = version.source
    mlmodel = _mlmodel(source, tracking_uri)
    path = mlmodel.get("flavors", {}).get("python_function", {}).get("artifacts", {}).get("model_dir", {}).get("path")
    if not path:
        raise UserError(f"serve: {name} version {version.version} ({source}) is not a kubealign actor (no model_dir)")
    return Served(name, str(version.version), alias, version.run_id or "", f"{source.rstrip('/')}/{path}", source)


def _mlmodel(source: str, tracking_uri: str) -> dict:
    import tempfile

    import mlflow.artifacts
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=posixpath.join(source, "MLmodel"), dst_path=tmp, tracking_uri=tracking_uri
        )
        with open(local, encoding="utf-8") as handle:
            return yaml.safe_load(handle) or {}


def check_listing(served: Served, tracking_uri: str) -> list[str]:
    """The directory's files, listed in the registry (no download): their names, or one line naming what is
    missing."""
    import mlflow.artifacts

    listed = mlflow.artifacts.list_artifacts(artifact_uri=served.model_dir_uri, tracking_uri=tracking_uri)
    names = [posixpath.basename(f.path) for f in listed if not f.is_dir]
    empty = [posixpath.basename(f.path) for f in listed if f.path.endswith(".safetensors") and not f.file_size]
    missing = missing_files(names) + [f"{n} is empty" for n in empty]
    if missing:
        raise UserError(
            f"serve: {served.name} version {served.version} ({served.model_dir_uri}) is not a servable model "
            f"directory: {', '.join(missing)}"
        )
    return names


def recorded_files(served: Served, tracking_uri: str) -> dict[str, Any]:
    """The version's provenance manifest (kubealign.provenance.manifest); one line when it has none: files that
    nothing records cannot be checked, and kubealign serves nothing unchecked."""
    from kubealign.provenance import manifest

    found = manifest.read(served.source, tracking_uri)
    if found is None:
        raise UserError(
            f"serve: {served.name} version {served.version} has no {manifest.MANIFEST_FILE} (registered without a "
            "provenance manifest): its files cannot be checked; promote it again to register it with one"
        )
    return found


def check_files(served: Served, directory: Any, recorded: dict[str, Any]) -> None:
    """The copy of the version's HF directory at `directory` against the manifest's digests: one line naming
    the first file that differs."""
    from kubealign.provenance.digests import verify

    verify(directory, recorded["files"], f"serve: {served.name} version {served.version}")


def check_remote(served: Served, tracking_uri: str, recorded: dict[str, Any]) -> None:
    """check_files on a temporary download of the directory (the serve task: KServe's storage initializer
    downloads the files again and checks no digest; this pod refuses to deploy files that differ)."""
    import tempfile
    from pathlib import Path

    import mlflow.artifacts

    with tempfile.TemporaryDirectory(prefix="kubealign-verify-") as tmp:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=served.model_dir_uri, dst_path=tmp, tracking_uri=tracking_uri
        )
        check_files(served, Path(local), recorded)
