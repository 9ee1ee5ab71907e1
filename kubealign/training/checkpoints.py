"""A sha256 manifest beside every DeepSpeed checkpoint, verified before `--resume` loads it.

DeepSpeed writes a checkpoint as SAVE_DIR/<tag>/... and then SAVE_DIR/latest naming the tag; nothing
checks the files on load, so a truncated copy, a bit flip or a swapped file (these are torch pickles)
resumes silently. After every save the ranks hash the tag's files between them (file i goes to rank
i mod world, so a large ZeRO checkpoint costs each rank 1/world of the reading) and rank 0 writes
SAVE_DIR/<tag>/kubealign-sha256.json. Before a load every rank checks its share and the ranks agree
on the verdict, so they all stop together with the same one-line error naming the file.

Commit: DeepSpeed writes `latest` by truncate-then-write during save_checkpoint, before anything is
sealed, so a kill at the wrong moment left an empty `latest` (and every --resume after it died in a
multi-line DeepSpeed assertion) or one naming a tag half written. kubealign saves with save_latest=False
and `commit`s instead: `latest` is written by rank 0 through a temporary file and a rename, only after
every part of the step is sealed (PPO: the actor's, the critic's and the EMA under one tag, one `latest`
for all). `resume_tag` takes the tag `latest` names when it is sealed, and otherwise (missing, empty,
dangling, unsealed) the newest tag sealed in every part, saying which.

Links: no symbolic link is followed anywhere under a checkpoint directory, the directory itself included.
A linked directory would have kubealign write and remove tags in the link's target (a user's folder holding
a `step9/` lost it at the stage's end); a link planted as the next tag, or as a file in it, would have
DeepSpeed write through it; `latest` naming `../elsewhere` would load a pickle from outside. So the
directory and its part directories must be real, `latest` must name a tag of kubealign's form, a tag is
written or loaded only when nothing in it is a link, and cleanup removes only tags that were sealed or that
this process wrote. Each refusal is one UserError naming the link.

Like DeepSpeed's own resume, this assumes every rank sees the same checkpoint directory (a shared
filesystem). A checkpoint without a manifest (written by an older kubealign) that `latest` names loads
with a warning: nothing to verify against, and refusing it would throw away a resumable run.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign import ranks
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
    if ranks.is_main():
        write_json(tag_dir / MANIFEST, {"tag": tag, "files": hashes})
    distributed.barrier()


def link_in(path: Path) -> Path | None:
    """PATH itself if it is a symbolic link, else the first link below it (no link is followed), else None."""
    if path.is_symlink():
        return path
    for root, dirs, files in os.walk(path):  # followlinks=False: a linked directory is listed, not entered
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(root, name)):
                return Path(root, name)
    return None


def refuse_links(path: Path, doing: str) -> None:
    """One UserError if PATH is, or holds, a symbolic link: DOING (e.g. "--resume") would follow it."""
    link = link_in(path)
    if link is not None:
        raise UserError(
            f"{doing}: {link} is a symbolic link (to {os.readlink(link)}); kubealign follows no link in a checkpoint "
            "directory: replace it with the real directory or file"
        )


def latest_tag(save_dir: Path) -> str | None:
    try:
        return (save_dir / "latest").read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def commit(save_dir: Path, tag: str) -> None:
    """Point SAVE_DIR/latest at TAG, atomically (rank 0; every rank waits): call after every part of the
    step is sealed. A reader sees the previous tag or this one, never an empty or partial name."""
    distributed.barrier()
    if ranks.is_main():
        tmp = save_dir / f".latest.tmp-{os.getpid()}"
        tmp.write_text(tag, encoding="utf-8")
        os.replace(tmp, save_dir / "latest")
    distributed.barrier()


def _step(tag: str) -> int:
    digits = re.findall(r"\d+", tag)
    return int(digits[-1]) if digits else -1


def sealed_tags(parts: list[Path]) -> list[str]:
    """The tags sealed (manifest written) in every part directory, newest step first."""
    if not parts[0].is_dir():
        return []
    tags = [d.name for d in parts[0].iterdir() if OWN_TAG.fullmatch(d.name) and (d / MANIFEST).is_file()]
    tags = [t for t in tags if all((part / t / MANIFEST).is_file() for part in parts[1:])]
    return sorted(tags, key=_step, reverse=True)


def resume_tag(save_dir: Path, parts: list[Path] | None = None) -> str | None:
    """The tag --resume loads from SAVE_DIR (parts: the directories that hold a step's pieces, each with
    TAG/kubealign-sha256.json; default SAVE_DIR itself), verified on every rank; None: nothing to resume.
    The tag `latest` names when it is sealed in every part (a sealed tag whose files changed is refused,
    as before); else the newest tag sealed in every part, with a warning naming why `latest` was passed
    over; a named tag with no manifest in any part (an older kubealign's) unverified, with a warning."""
    parts = parts or [save_dir]
    named = latest_tag(save_dir)
    foreign = named is not None and not OWN_TAG.fullmatch(named)  # e.g. ../elsewhere/step9: never opened
    named = None if foreign else named
    sealed = sealed_tags(parts)
    if named is not None and named in sealed:
        for part in parts:
            verify(part, named)
        return named
    if named is not None and all((part / named).is_dir() for part in parts) and not sealed:
        for part in parts:
            refuse_links(part / named, "--resume")
        log.warning("--resume: %s has no %s; loading it unverified", save_dir / named, MANIFEST)
        return named
    if not sealed:
        return None
    if foreign:
        why = f"names {latest_tag(save_dir)!r}, which is not a kubealign checkpoint tag"
    elif named is None:
        why = "is empty" if (save_dir / "latest").is_file() else "is missing"
    elif not all((part / named).is_dir() for part in parts):
        why = f"names {named}, which is not there"
    else:
        why = f"names {named}, which was never sealed (the save was interrupted)"
    tag = sealed[0]
    for part in parts:
        verify(part, tag)
    log.warning("--resume: %s %s; resuming from %s, the newest sealed checkpoint", save_dir / "latest", why, tag)
    return tag


def _problem(tag_dir: Path, expected: dict[str, str]) -> str | None:
    names = sorted(expected)
    extra = sorted(set(_files(tag_dir)) - set(names))
    if extra and ranks.is_main():
        return f"{tag_dir / extra[0]} is not in the checkpoint's sha256 manifest"
    for name in _share(names):
        path = tag_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != expected[name]:
            return f"{path} does not match the checkpoint's sha256 manifest (changed since it was saved)"
    return None


def verify(save_dir: Path, tag: str | None = None) -> None:
    """Check TAG (default: the one `latest` names) in SAVE_DIR against its manifest on every rank; raise one
    UserError on all ranks when any rank finds a missing or changed file."""
    tag = tag or latest_tag(save_dir)
    if tag is None:
        return
    if not OWN_TAG.fullmatch(tag):
        raise UserError(f"--resume: {save_dir / 'latest'} names {tag!r}, which is not a kubealign checkpoint tag")
    tag_dir = save_dir / tag
    refuse_links(tag_dir, "--resume")
    if not (tag_dir / MANIFEST).is_file():
        log.warning("--resume: %s has no %s; loading it unverified", tag_dir, MANIFEST)
        return
    manifest = read_json(tag_dir, MANIFEST, "a checkpoint manifest")
    problem = _problem(tag_dir, manifest.get("files", {}))
    problems = [p for p in _gather({str(ranks.rank()): problem or ""}).values() if p]
    if problems:
        raise UserError(f"--resume: {sorted(problems)[0]}; refusing to resume from it")


def load(engine: Any, save_dir: Path, tag: str, **kwargs: Any) -> dict[str, Any]:
    """engine.load_checkpoint(SAVE_DIR, TAG) -> its client state; any failure is one UserError naming the
    checkpoint (DeepSpeed's own are multi-line assertions and tracebacks)."""
    try:
        path, state = engine.load_checkpoint(str(save_dir), tag=tag, **kwargs)
    except Exception as exc:  # a torn or foreign checkpoint: whatever DeepSpeed or torch raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--resume: cannot load the checkpoint {save_dir / tag}: {first}") from None
    if path is None:
        raise UserError(f"--resume: cannot load the checkpoint {save_dir / tag}")
    return state or {}


# What kubealign (and DeepSpeed inside it) writes in a checkpoint directory: the step / iteration tags, the
# `latest` pointer and its temporary file, DeepSpeed's ZeRO recovery script, and PPO's part directories.
OWN_TAG = re.compile(r"(step|iter)\d+")
OWN_FILES = ("latest", "zero_to_fp32.py")
PARTS = ("actor", "critic")


def _ours(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        return bool(OWN_TAG.fullmatch(path.name))
    return path.name in OWN_FILES or path.name.startswith(".latest.tmp-")


def _entries(save_dir: Path) -> list[Path]:
    """Everything in SAVE_DIR and in its PPO part directories (the parts themselves excluded)."""
    if not save_dir.is_dir():
        return []
    found: list[Path] = []
    for entry in sorted(save_dir.iterdir()):
        if entry.name in PARTS and entry.is_dir() and not entry.is_symlink():
            found += sorted(entry.iterdir())
        else:
            found.append(entry)
    return found


def check_fresh(save_dir: Path) -> None:
    """Before a run that does not --resume: SAVE_DIR must be absent or empty. Checkpoints of an earlier run
    would mix with this run's tags (and a later --resume would take whichever is newest); anything else
    there is the user's, which the run's cleanup must not touch either. One UserError naming what is there."""
    entries = _entries(save_dir)
    foreign = [e for e in entries if not _ours(e)]
    if foreign:
        raise UserError(
            f"{save_dir} holds {foreign[0].relative_to(save_dir)}, which kubealign did not write; the checkpoints "
            "of this output go there: move it, or choose another --output"
        )
    tags = sorted({e.name for e in entries if e.is_dir()}, key=_step)
    if tags:
        raise UserError(
            f"{save_dir} holds the checkpoints of an earlier run (up to {tags[-1]}): pass --resume to continue "
            "it, or remove that directory to start over"
        )


def checkpoint_dir(output: Path, resume: bool, location: Path | None = None) -> Path:
    """Where a training stage writing OUTPUT keeps its checkpoints: LOCATION (--checkpoints; on a cluster the
    task's directory on the PVC, see kubealign.tasks.launch.checkpoint_location), else OUTPUT.checkpoints;
    checked at the stage's start like --output (check_fresh) unless the run resumes from it. A link there, as
    the directory or as a part directory, is refused either way (module docstring)."""
    directory = location if location is not None else Path(f"{output}.checkpoints")
    for path in (directory, *(directory / part for part in PARTS)):
        if path.is_symlink():
            raise UserError(
                f"{path} is a symbolic link (to {os.readlink(path)}); kubealign writes and removes checkpoints "
                "only in a real directory: pass that directory as --checkpoints, or remove the link"
            )
    if not resume:
        check_fresh(directory)
    return directory


# The tag directories this process began to write (saving): cleanup may remove these even when unsealed.
WRITTEN: set[str] = set()


def _removable(entry: Path) -> bool:
    """A tag kubealign sealed or this process wrote, or one of kubealign's own files; never a link's target."""
    if not _ours(entry):
        return False
    if entry.is_dir():
        return (entry / MANIFEST).is_file() or os.path.abspath(entry) in WRITTEN
    return True


def remove(save_dir: Path) -> None:
    """After a stage finished: remove what kubealign wrote in SAVE_DIR (tags sealed or written by this
    process, `latest`, DeepSpeed's script, in the PPO part directories too), then each directory left empty.
    Anything else stays where it is, a torn tag of an earlier run too (rank 0; every rank waits)."""
    distributed.barrier()
    if ranks.is_main() and not save_dir.is_symlink():
        for entry in _entries(save_dir):
            if _removable(entry):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        for directory in [*(save_dir / part for part in PARTS), save_dir]:
            if directory.is_dir() and not any(directory.iterdir()):
                with contextlib.suppress(OSError):  # e.g. a mount point: the directory itself is not ours to drop
                    directory.rmdir()
    distributed.barrier()


# What running out of room looks like while DeepSpeed / torch write a checkpoint: an OSError with one of these
# errnos, or torch's zip writer failing on a short write (a RuntimeError: "unexpected pos ...", "file write
# failed"), which names no cause at all.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
SHORT_WRITE = ("unexpected pos", "file write failed", "No space left")


@contextlib.contextmanager
def saving(save_dir: Path, tag: str, stage: str, parts: list[Path] | None = None) -> Iterator[None]:
    """Around one checkpoint save of TAG (in SAVE_DIR, or in each of PARTS): a full disk, a quota or a
    read-only file system becomes one UserError naming the directory, its free space and the last good
    checkpoint, and the torn TAG is removed (it was never committed: `latest` still names the last good one).
    Any other failure passes through unchanged. A link at TAG, or in it, is refused before anything is written
    (DeepSpeed would write through it)."""
    for part in parts or [save_dir]:
        refuse_links(part / tag, f"{stage}: saving {tag}")  # an absent TAG holds no link
        WRITTEN.add(os.path.abspath(part / tag))
    try:
        yield
    except (OSError, RuntimeError) as exc:
        no_room = isinstance(exc, OSError) and exc.errno in NO_ROOM
        if not no_room and not any(text in str(exc) for text in SHORT_WRITE):
            raise
        for part in parts or [save_dir]:
            if (part / tag).is_dir() and latest_tag(save_dir) != tag:
                shutil.rmtree(part / tag, ignore_errors=True)
        free = shutil.disk_usage(save_dir).free / 2**20
        if isinstance(exc, OSError) and exc.errno:
            why = os.strerror(exc.errno)
        else:  # torch's zip writer says only that a write came up short
            why = "No space left on device" if free < 1 else "a short write (disk full?)"
        last = latest_tag(save_dir)
        kept = f"the last good checkpoint, {save_dir / last}, is kept" if last else "there is no earlier checkpoint"
        raise UserError(
            f"{stage}: cannot save the checkpoint {save_dir / tag}: {why}; {free:.1f} MiB free in {save_dir}; "
            f"the partial {tag} was removed and {kept}"
        ) from None
