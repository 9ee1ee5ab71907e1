"""Stage outputs appear atomically, and every stage leaves a result.json.

A stage builds its output in a temporary sibling directory and renames it into place only when it is
complete, so a failed or killed run never leaves a half-written output that a later run (or a KFP
cache) could mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign.errors import UserError

RESULT_FILE = "result.json"


def check_output_path(output: Path) -> None:
    """Fail early, before any work, when --output cannot become a directory."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output}: exists and is not a directory")
    parent = output.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise UserError(f"--output {output}: parent directory {parent} is not writable")


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `final`, on error it is removed."""
    final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
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


def tree_sha256(directory: Path) -> str:
    """Content hash of a directory: relative paths and file bytes, in sorted order (hidden temp files
    of an in-progress atomic write excluded)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        digest.update(rel.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()
