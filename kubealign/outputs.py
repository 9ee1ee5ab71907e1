"""Stage outputs appear atomically, and every stage leaves a result.json.

A stage builds its output in a temporary sibling directory and renames it into place only when it is
complete, so a failed or killed run never leaves a half-written output that a later run (or a KFP
cache) could mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubealign.errors import UserError

RESULT_FILE = "result.json"


def check_output_path(output: Path, stage: str) -> None:
    """Fail early, before any work, when --output cannot become this stage's output directory.

    An existing --output is replaced only when it is empty or a previous output of the same stage
    (its result.json says so): kubealign never deletes what it did not write (`--output .` or a
    directory of notes is refused, not emptied).
    """
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: exists and is not a directory")
    if output.is_dir():
        owner = output_stage(output)
        if owner is not None and owner != stage:
            raise UserError(
                f"--output {output}: holds a {owner!r} output, not a {stage!r} one; choose another directory"
            )
        if owner is None and any(output.iterdir()):
            raise UserError(
                f"--output {output}: exists, is not empty and is not a kubealign {stage} output "
                "(no result.json); kubealign replaces only its own outputs: choose a new or empty directory"
            )
    parent = output.resolve().parent
    while not parent.exists() and parent != parent.parent:  # the nearest existing ancestor must be writable
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise UserError(f"--output {output}: {parent} is not writable")


def output_stage(directory: Path) -> str | None:
    """The stage named by DIR/result.json, or None when DIR holds no readable kubealign result."""
    try:
        stage = json.loads((directory / RESULT_FILE).read_text(encoding="utf-8")).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return stage if isinstance(stage, str) else None


class ConcurrentWriteError(UserError):
    """Another process replaced the same --output while this one was writing it."""


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `final`, on error it is removed.

    The swap is a pair of renames, each atomic on one filesystem: the previous output (checked again:
    empty, or a result.json of the same stage as the new one) moves aside, the new one moves in, the
    previous one is deleted. With two writers at once, exactly one rename of each pair succeeds; the
    loser gets a one-line ConcurrentWriteError, the winner's output stays whole, no temporary
    directory is left behind, and `final` never holds a mix of the two.
    """
    final = final.resolve()
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as exc:
        raise UserError(f"--output {final}: cannot create it: {exc.strerror or exc}") from None
    try:
        yield tmp
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _non_empty(directory: Path) -> bool:
    try:
        return any(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # moved away by a concurrent writer meanwhile
        return False


def _swap_in(tmp: Path, final: Path) -> None:
    new_stage = output_stage(tmp)
    old = None
    if final.exists():
        seen = _inode(final)
        owner = output_stage(final)
        foreign = owner is None and _non_empty(final)
        if _inode(final) != seen:  # another writer swapped it while we looked: what we saw is not one dir
            raise ConcurrentWriteError(
                f"--output {final}: another process replaced it at the same time; its output is kept"
            )
        if foreign:
            raise UserError(f"--output {final}: now holds files kubealign did not write; left untouched")
        if owner is not None and new_stage is not None and owner != new_stage:
            raise UserError(f"--output {final}: now holds a {owner!r} output; left untouched")
        if owner is not None:
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            try:
                final.rename(old / "previous")  # atomic: of two writers, one moves it, the other finds none
            except FileNotFoundError:
                old.rmdir()
                raise ConcurrentWriteError(
                    f"--output {final}: another process replaced it at the same time; its output is kept"
                ) from None
    try:
        tmp.rename(final)  # replaces an empty directory, fails on a non-empty one
    except OSError as exc:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ConcurrentWriteError(
                f"--output {final}: another process wrote it at the same time; its output is kept"
            ) from None
        raise UserError(f"--output {final}: cannot move the new output into place: {exc.strerror}") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file and os.replace, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_result(
    directory: Path, stage: str, metrics: dict[str, float], outputs: dict[str, str], **extra: Any
) -> dict[str, Any]:
    """Write DIR/result.json: the stage's metrics and the paths it produced (relative to DIR)."""
    payload = {"stage": stage, "metrics": metrics, "outputs": outputs, **extra}
    write_json(directory / RESULT_FILE, payload)
    return payload


def read_json(directory: Path, name: str, what: str) -> dict[str, Any]:
    """Read DIR/NAME, a JSON file kubealign wrote; `what` says what DIR should be when it is missing."""
    path = directory / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{directory}: no {name}; {what}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None


def read_result(directory: Path) -> dict[str, Any]:
    """Read DIR/result.json written by an earlier stage."""
    return read_json(directory, RESULT_FILE, "is this a kubealign stage output?")


def tree_sha256(directory: Path, skip: Callable[[str], bool] | None = None) -> str:
    """Content hash of a directory: relative paths and file bytes, in sorted order (hidden temp files
    of an in-progress atomic write excluded, and files whose relative path `skip` accepts)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts) or (skip is not None and skip(rel)):
            continue
        digest.update(rel.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()
