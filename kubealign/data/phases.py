"""Find and load one phase of a data-split output for a training stage.

`--data` may be the data-split output dir (the stage picks its phase) or a phase dir itself. Handing a
stage another stage's phase (a phase-3 dir to SFT) is an error: the phases are disjoint on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.data.split import PHASES
from kubealign.errors import UserError, first_line


def resolve(data: Path, phase: str) -> Path:
    """The phase dir to read: DIR/phase when DIR is a data-split output, DIR when it is that phase."""
    if not data.exists():
        raise UserError(f"--data {data}: no such directory")
    if not data.is_dir():
        raise UserError(f"--data {data}: not a directory (expected a data-split output or its {phase} dir)")
    if (data / phase).is_dir():
        return data / phase
    if data.name in PHASES and data.name != phase:
        raise UserError(f"--data {data}: is {data.name}; this stage trains on {phase} (or give the data-split dir)")
    if not (data / "dataset_dict.json").is_file():
        raise UserError(f"--data {data}: neither a data-split output (no {phase}/) nor a saved dataset dict")
    return data


def load(data: Path, phase: str, need_rejected: bool = False) -> Any:
    """The phase's DatasetDict (train and eval splits) with the columns the stage needs."""
    import datasets

    path = resolve(data, phase)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged or foreign directory
        raise UserError(f"--data {path}: cannot load the dataset ({first_line(exc)})") from None
    if not isinstance(loaded, datasets.DatasetDict) or "train" not in loaded:
        raise UserError(f"--data {path}: expected a dataset dict with a train split")
    need = {"prompt", "chosen"} | ({"rejected"} if need_rejected else set())
    missing = need - set(loaded["train"].column_names)
    if missing:
        raise UserError(f"--data {path}: missing columns {sorted(missing)}")
    if need_rejected and None in loaded["train"]["rejected"]:
        raise UserError(f"--data {path}: rows without a rejected response; the reward stage needs pairs")
    return loaded
