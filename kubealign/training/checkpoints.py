"""A sha256 manifest beside every DeepSpeed checkpoint, verified before `--resume` loads it.

DeepSpeed writes a checkpoint as SAVE_DIR/<tag>/... and then SAVE_DIR/latest naming the tag; nothing
checks the files on load, so a truncated copy, a bit flip or a swapped file (these are torch pickles)
resumes silently. After every save the ranks hash the tag's files between them (file i goes to rank
i mod world, so a large ZeRO checkpoint costs each rank 1/world of the reading) and rank 0 writes
SAVE_DIR/<tag>/kubealign-sha256.json. Before a load every rank checks its share and the ranks agree
on the verdict, so they all stop together with the same one-line error naming the file.

Like DeepSpeed's own resume, this assumes every rank sees the same checkpoint directory (a shared
filesystem). A checkpoint without a manifest (written by an older kubealign, or killed between
`latest` and the manifest) loads with a warning: nothing to verify against, and refusing it would
throw away a resumable run.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from kubealign.errors import UserError
from kubealign.outputs import read_json, write_json
from kubealign.training import distributed

log = logging.getLogger(__name__)
MANIFEST = "kubealign-sha256.json"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(tag_dir: Path) -> list[str]:
    return sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _share(names: list[str]) -> list[str]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def _gather(mine: dict[str, str]) -> dict[str, str]:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {name: sha for part in parts for name, sha in (part or {}).items()}


def seal(save_dir: Path, tag: str) -> None:
    """Write SAVE_DIR/TAG/kubealign-sha256.json; call on every rank right after save_checkpoint."""
    distributed.barrier()  # every rank's shards are on disk before anyone hashes
    tag_dir = save_dir / tag
    names = _files(tag_dir)
    hashes = _gather({name: file_sha256(tag_dir / name) for name in _share(names)})
    if distributed.rank() == 0:
        write_json(tag_dir / MANIFEST, {"tag": tag, "files": hashes})
    distributed.barrier()


def latest_tag(save_dir: Path) -> str | None:
    try:
        return (save_dir / "latest").read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def _problem(tag_dir: Path, expected: dict[str, str]) -> str | None:
    names = sorted(expected)
    extra = sorted(set(_files(tag_dir)) - set(names))
    if extra and distributed.rank() == 0:
        return f"{tag_dir / extra[0]} is not in the checkpoint's sha256 manifest"
    for name in _share(names):
        path = tag_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != expected[name]:
            return f"{path} does not match the checkpoint's sha256 manifest (changed since it was saved)"
    return None


def verify(save_dir: Path) -> None:
    """Check the latest checkpoint in SAVE_DIR against its manifest on every rank; raise one UserError on
    all ranks when any rank finds a missing or changed file."""
    tag = latest_tag(save_dir)
    if tag is None:
        return
    tag_dir = save_dir / tag
    if not (tag_dir / MANIFEST).is_file():
        log.warning("--resume: %s has no %s; loading it unverified", tag_dir, MANIFEST)
        return
    manifest = read_json(tag_dir, MANIFEST, "a checkpoint manifest")
    problem = _problem(tag_dir, manifest.get("files", {}))
    problems = [p for p in _gather({str(distributed.rank()): problem or ""}).values() if p]
    if problems:
        raise UserError(f"--resume: {sorted(problems)[0]}; refusing to resume from it")
