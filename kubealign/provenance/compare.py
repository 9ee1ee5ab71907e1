"""A remade model against its registered version: the weight files' digests, and where they differ, by how much.

`kubealign reproduce` reruns a version's recipe (kubealign.provenance.manifest) and compares what it made
against what the manifest records. Bit-equal weight files are the proof; where they cannot be (GPU kernels, a
different device or library), the largest absolute difference of any parameter, tensor by tensor, and the
evaluation figures side by side say how far the rerun landed. Only weight files count: a training stage's
result.json holds timings and differs in every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from kubealign.provenance.manifest import weights


class WeightsCompared(NamedTuple):
    identical: list[str]  # weight files whose digests equal the manifest's
    different: list[str]  # present on both sides, digests differ
    missing: list[str]  # recorded, not made by the rerun
    extra: list[str]  # made by the rerun, not recorded


def compare_weights(made: dict[str, str], recorded: dict[str, str]) -> WeightsCompared:
    """made / recorded: {path: sha256} of every file (digests.file_digests, the manifest's files)."""
    ours, theirs = weights(made), weights(recorded)
    both = sorted(set(ours) & set(theirs))
    return WeightsCompared(
        identical=[rel for rel in both if ours[rel] == theirs[rel]],
        different=[rel for rel in both if ours[rel] != theirs[rel]],
        missing=sorted(set(theirs) - set(ours)),
        extra=sorted(set(ours) - set(theirs)),
    )


def largest_difference(made: Path, recorded: Path) -> dict[str, Any]:
    """{"max_abs_diff": the largest |a - b| over every parameter of the safetensors files present in both
    directories, "tensor": where it is ("file:name"), "shapes_differ": tensors present on one side only or
    shaped differently}."""
    from safetensors.torch import load_file

    largest, where, odd = 0.0, None, []
    for path in sorted(made.rglob("*.safetensors")):
        rel = path.relative_to(made).as_posix()
        if not (recorded / rel).is_file():
            continue
        a, b = load_file(str(path)), load_file(str(recorded / rel))
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b or a[name].shape != b[name].shape:
                odd.append(f"{rel}:{name}")
                continue
            diff = (a[name].double() - b[name].double()).abs().max().item() if a[name].numel() else 0.0
            if where is None or diff > largest:
                largest, where = diff, f"{rel}:{name}"
    return {"max_abs_diff": largest, "tensor": where, "shapes_differ": odd}


def figures_side_by_side(recorded: dict[str, float], made: dict[str, float], names: tuple[str, ...]) -> list[str]:
    """One line per evaluation figure both runs have: the version's, the rerun's, the difference."""
    lines = []
    for name in names:
        if name in recorded and name in made:
            a, b = float(recorded[name]), float(made[name])
            lines.append(f"{name}: registered {a:.4f}, remade {b:.4f} ({b - a:+.4f})")
    return lines
