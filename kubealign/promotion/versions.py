"""Registered versions: one per promotion key (sha256 of the evaluation and the weights), the model logged
from code (kubealign.promotion.registry, explicit pip requirements, no pickle). Two promotes of one evaluation
register one version; a version registered under a lease that was broken while its holder lived is
deleted again when an older version carries the same key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.provenance.manifest import MANIFEST_FILE, dumps

KEY_TAG = "kubealign.promotion_key"


def promotion_key(evaluation: Path, model_dir: Path) -> str:
    digest = hashlib.sha256((evaluation / "result.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(hashlib.sha256(weights.read_bytes()).digest())
    return digest.hexdigest()


def find_version(client: Any, name: str, key: str) -> Any:
    """The oldest version carrying this promotion key, or None."""
    found = client.search_model_versions(f"name = '{name}' and tag.`{KEY_TAG}` = '{key}'")
    return min(found, key=lambda v: int(v.version), default=None)


def upload_model(client: Any, run_id: str, model_dir: Path, manifest: dict[str, Any]) -> str:
    """Log the actor as a pyfunc model into the run's artifacts, with its provenance manifest beside MLmodel
    (kubealign.provenance.manifest); its source URI for a model version.
    Only MlflowClient calls: the fluent API would leave a process-wide tracking/registry URI behind."""
    import tempfile

    import mlflow.pyfunc

    from kubealign.promotion.registry import INPUT_EXAMPLE, MODEL_CODE

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
        (Path(tmp) / "model" / MANIFEST_FILE).write_text(dumps(manifest), encoding="utf-8")
        client.log_artifacts(run_id, str(Path(tmp) / "model"), "model")
    return f"{client.get_run(run_id).info.artifact_uri}/model"


def register_version(client: Any, name: str, source: str, run_id: str, key: str, tags: dict[str, str]) -> Any:
    """A new version carrying the key; if an older one carries it too (only possible if a lease was
    broken while its holder lived), this one is deleted again and the older one returned."""
    created = client.create_model_version(name, source=source, run_id=run_id, tags={KEY_TAG: key, **tags})
    oldest = find_version(client, name, key)
    if oldest is not None and str(oldest.version) != str(created.version):
        client.delete_model_version(name, created.version)
        return oldest
    return created


def manifest_check(version: Any, source: str, tracking_uri: str) -> tuple[bool, str]:
    """The gate's provenance check of a version: its manifest is among its artifacts and is the one its tag
    names (kubealign.provenance.manifest). A version registered without one cannot be verified where it is
    served, nor remade: it is refused."""
    from kubealign.provenance import manifest

    tag = (version.tags or {}).get(manifest.TAG + "model_sha256")
    found = manifest.read(source, tracking_uri)
    where = f"version {version.version}"
    if found is None:
        return (
            False,
            f"provenance: {where} has no {manifest.MANIFEST_FILE} among its artifacts (registered without one)",
        )
    if tag != found.get("model_sha256"):
        return (
            False,
            f"provenance: {where}'s {manifest.MANIFEST_FILE} does not match its tag {manifest.TAG}model_sha256",
        )
    return True, f"provenance: {manifest.MANIFEST_FILE} recorded, model sha256 {str(tag)[:12]}…"
