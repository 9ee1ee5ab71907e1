"""Data lineage in MLflow: which data each run read, as MLflow dataset inputs (`log_inputs`).

data-split names every source it read (context `source`: its path, the sha256 of its rows, rows read); every
stage after it names the data-split phase it trained or evaluated on (context `training` or `evaluation`: the
phase's content sha256 from the split's manifest, the split directory, its rows per split). A registered
version's run then leads, through its parent pipeline run's stages, to the exact data behind it; the same
digest on two runs is the same data. MLflow keeps a dataset digest of at most 36 characters: the first 36 of
the sha256, the whole of it in the profile.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

DIGEST_LENGTH = 36  # MLflow's datasets.digest column


class DatasetRef(NamedTuple):
    name: str
    sha256: str
    source: str  # where it is: a source path, or the split directory
    source_type: str  # local, synthetic, hub, or data-split
    context: str  # source, training or evaluation: the input tag mlflow.data.context
    profile: dict[str, Any]  # row counts, the whole sha256


def source_refs(manifest: dict[str, Any]) -> list[DatasetRef]:
    """data-split's inputs: each source of the manifest (its `sources` entries), in order."""
    refs = []
    for i, s in enumerate(manifest.get("sources", [])):
        profile = {"rows_read": s.get("rows_read"), "sha256": s["sha256"], "index": i}
        refs.append(DatasetRef(s["path"], s["sha256"], s["path"], s.get("kind", "local"), "source", profile))
    return refs


def phase_ref(split: Path, phase: str, context: str) -> DatasetRef | None:
    """A stage's input: `phase` of the data-split output `split`, from its manifest; None where the directory has
    no manifest (data prepared another way: nothing is claimed)."""
    path = Path(split) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        entry = manifest["phases"][phase]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rows = {name: split_info.get("rows") for name, split_info in entry.get("splits", {}).items()}
    profile = {"rows": rows, "sha256": entry["sha256"], "cache_key": manifest.get("cache_key")}
    return DatasetRef(phase, entry["sha256"], str(Path(split).resolve()), "data-split", context, profile)


def entities(refs: list[DatasetRef]) -> list[Any]:
    """MLflow DatasetInput entities of the refs."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    return [
        DatasetInput(
            Dataset(
                name=r.name,
                digest=r.sha256[:DIGEST_LENGTH],
                source_type=r.source_type,
                source=json.dumps({"uri": r.source}),
                profile=json.dumps(r.profile, sort_keys=True),
            ),
            [InputTag("mlflow.data.context", r.context)],
        )
        for r in refs
    ]
