"""The files of a model directory as sha256 digests, and the check of a copy against them.

A registered version's manifest (kubealign.provenance.manifest) records one digest per file of the HF directory
promote uploaded (weights, config, tokenizer: everything a server loads), and one digest over all of them, the
version's `model_sha256`. Where the files are used (kubealign serve, the serve task, feedback push) the copy at
hand is hashed again before anything loads it: a byte flipped in the registry's storage, a truncated download
or a file swapped under the same name is one line naming the file, not a model that quietly differs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kubealign.errors import UserError

BLOCK = 1 << 20  # streamed: a 2.6 GB safetensors file is never read into memory whole


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(directory: Path) -> dict[str, str]:
    """{relative POSIX path: sha256} of every file below `directory`, hidden ones (a download's or an atomic
    write's markers) left out."""
    found = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if not any(part.startswith(".") for part in Path(rel).parts):
            found[rel] = file_sha256(path)
    return found


def combined_sha256(files: dict[str, str]) -> str:
    """One digest for a whole directory: over the sorted (path, file digest) pairs, so that a renamed file
    changes it as a changed byte does."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{files[rel]}\n".encode())
    return digest.hexdigest()


def mismatches(files: dict[str, str], expected: dict[str, str]) -> list[str]:
    """What differs between a copy's digests and the recorded ones, a phrase per file, in path order (empty
    when they are equal). A file the record lacks counts: a server loads what is in the directory."""
    problems = []
    for rel in sorted(set(files) | set(expected)):
        if rel not in files:
            problems.append(f"{rel} is missing")
        elif rel not in expected:
            problems.append(f"{rel} is not in the manifest")
        elif files[rel] != expected[rel]:
            problems.append(f"{rel} has sha256 {files[rel][:12]}…, the manifest records {expected[rel][:12]}…")
    return problems


def verify(directory: Path, expected: dict[str, str], what: str) -> None:
    """Raise one line (`what`: whose files these are) when the files below `directory` are not exactly those
    recorded in `expected`."""
    problems = mismatches(file_digests(directory), expected)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{what}: {problems[0]}{more}: the files are not the registered ones; refusing to load them")
