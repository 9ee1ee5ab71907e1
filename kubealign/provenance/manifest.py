"""A registered version's manifest: everything needed to audit it and to make it again, in one JSON file.

promote writes `provenance.json` beside the version's MLmodel (so it is one of the version's own artifacts) and
copies its key fields into version tags (TAGS) that the registry's UI and search show. It holds:
- files: the sha256 of every file of the HF directory served (kubealign.provenance.digests) and model_sha256,
  one digest over them all, also the KServe manifest's annotation;
- config: the resolved config the pipeline ran with, and the seeds in it;
- code: kubealign's version, the commit (the image's KUBEALIGN_REVISION, else the git checkout's HEAD, with
  `dirty` when tracked files differ from it), the package's source digest, the lock's digest (from a checkout)
  and a digest of the installed distributions (name==version, sorted; what a lock pins, read from the
  environment itself, so an image without the repo has it too);
- data: the data-split manifest's cache key, every source with its digest and rows, each phase's digests;
- training: the route, world size, the training process's device and library versions, the rollout engine
  and path, and the largest rollout-trainer log-prob difference any iteration measured;
- evaluation: the gate's figures; runs: the pipeline run and promote's run in MLflow.
The gate refuses a version without one (kubealign.promotion.gate's caller); `kubealign reproduce` reruns it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.provenance.digests import combined_sha256

MANIFEST_FILE = "provenance.json"
SCHEMA = 1
TAG = "kubealign.provenance."
LIBRARIES = ("torch", "transformers", "deepspeed", "peft", "datasets", "mlflow", "vllm")
WEIGHTS = (".safetensors", ".bin", ".pt")
REVISION_ENV = "KUBEALIGN_REVISION"  # set in the images from their build's REVISION (images/cpu/Dockerfile)


def environment() -> dict[str, Any]:
    """The process's device and library versions: a training stage records them in its result.json."""
    import torch

    versions = {}
    for name in LIBRARIES:
        versions[name] = _version(name) or (_version(f"{name}-cpu") if name == "vllm" else None)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def code_identity(package: Path | None = None) -> dict[str, Any]:
    """kubealign's version, commit, source digest, lock digest and installed distributions' digest. package: the
    kubealign package directory (default: this one's), whose parent is the checkout when there is one."""
    package = package or Path(__file__).resolve().parents[1]
    repo = package.parent
    commit, dirty = os.environ.get(REVISION_ENV) or None, None
    if commit is None and (repo / ".git").exists():
        commit, dirty = _git(repo, "rev-parse", "HEAD"), bool(_git(repo, "status", "--porcelain", "-uno"))
    lock = repo / "requirements" / "lock-cpu.txt"
    return {
        "kubealign": __version__,
        "commit": commit or "unknown",
        "dirty": dirty,
        "package_sha256": _package_sha256(package),
        "lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest() if lock.is_file() else None,
        "distributions_sha256": _distributions_sha256(),
    }


def _git(repo: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _package_sha256(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _distributions_sha256() -> str:
    from importlib import metadata

    pins = sorted({f"{d.metadata['Name']}=={d.version}".lower() for d in metadata.distributions() if d.metadata})
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()


def training_record(result: dict[str, Any]) -> dict[str, Any]:
    """What the training stage's result.json says of how the candidate was made. max_logprob_diff: the largest
    |log pi_trainer - log pi_rollout| of any iteration (None where nothing was sampled, as in dpo)."""
    history = result.get("history") or []
    diffs = [h["rollout_logprob_diff_max"] for h in history if "rollout_logprob_diff_max" in h]
    means = [h["rollout_logprob_diff_mean"] for h in history if "rollout_logprob_diff_mean" in h]
    return {
        "stage": result.get("stage"),
        "algorithm": result.get("algorithm") or result.get("stage"),
        "world_size": (result.get("metrics") or {}).get("world_size"),
        "environment": result.get("environment"),
        "rollout_engine": result.get("rollout_engine"),
        "rollout_path": result.get("rollout_path"),
        "max_logprob_diff": max(diffs) if diffs else None,
        "max_logprob_diff_mean": max(means) if means else None,
    }


def seeds(config: dict[str, Any]) -> dict[str, int]:
    """Every `seed` field of the resolved config, by section."""
    return {
        f"{section}.seed": values["seed"]
        for section, values in config.items()
        if isinstance(values, dict) and "seed" in values
    }


def build(
    config: dict[str, Any],
    files: dict[str, str],
    training: dict[str, Any],
    data: dict[str, Any] | None,
    evaluation: dict[str, float],
    runs: dict[str, str],
    code: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of one version (config: the resolved config as JSON data; files: digests.file_digests of
    the directory registered; data: the data-split manifest, None when it is not at hand)."""
    return {
        "schema": SCHEMA,
        "model_sha256": combined_sha256(files),
        "files": files,
        "config": config,
        "seeds": seeds(config),
        "code": code if code is not None else code_identity(),
        "data": _data_record(data),
        "training": training,
        "evaluation": evaluation,
        "runs": runs,
    }


def _data_record(data: dict[str, Any] | None) -> dict[str, Any] | None:
    if data is None:
        return None
    phases = {name: {k: v for k, v in p.items() if k.endswith("sha256")} for name, p in data.get("phases", {}).items()}
    return {
        "cache_key": data.get("cache_key"),
        "config_sha256": data.get("config_sha256"),
        "sources": data.get("sources", []),
        "phases": phases,
    }


def tags(manifest: dict[str, Any]) -> dict[str, str]:
    """The manifest's key fields as version tags (TAG + name)."""
    env = (manifest["training"].get("environment") or {}).get("versions") or {}
    fields = {
        "model_sha256": manifest["model_sha256"],
        "commit": manifest["code"]["commit"],
        "lock_sha256": manifest["code"]["lock_sha256"],
        "data_cache_key": (manifest["data"] or {}).get("cache_key"),
        "device": (manifest["training"].get("environment") or {}).get("device"),
        "rollout_engine": manifest["training"].get("rollout_engine"),
        "max_logprob_diff": manifest["training"].get("max_logprob_diff"),
        **{name: env.get(name) for name in ("torch", "transformers", "deepspeed", "vllm")},
    }
    return {TAG + k: str(v) for k, v in fields.items() if v is not None}


def weights(files: dict[str, str]) -> dict[str, str]:
    """The weight files among a manifest's files: what reproduce compares (result.json holds timings)."""
    return {rel: digest for rel, digest in files.items() if rel.endswith(WEIGHTS)}


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True)


def read(source: str, tracking_uri: str) -> dict[str, Any] | None:
    """The manifest among a registered version's artifacts (`source`: the version's source URI), or None when
    it has none that reads as one (a version registered before manifests were written)."""
    import posixpath
    import tempfile

    import mlflow.artifacts

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a small file: no bar on screen
    with tempfile.TemporaryDirectory(prefix="kubealign-provenance-") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=posixpath.join(source.rstrip("/"), MANIFEST_FILE), dst_path=tmp, tracking_uri=tracking_uri
            )
            manifest = json.loads(Path(local).read_text(encoding="utf-8"))
        except Exception:  # absent (MlflowException, OSError by store) or not JSON: no manifest to trust
            return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None
