"""Find and load one phase of a data-split output for a training stage.

`--data` may be the data-split output dir (the stage picks its phase) or a phase dir itself. Handing a
stage another stage's phase (a phase-3 dir to SFT) is an error: the phases are disjoint on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

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


class Rows(NamedTuple):
    """Phase-3 rows behind a batch of prompts or responses, one entry each: what reward functions read."""

    prompts: list[str]  # the prompt text as in the data (not the token-cut one)
    columns: dict[str, list[Any]]  # the rows' other fields (a prompt-only row's, e.g. answer), one list each
    origins: list[str]  # each row's data-split origin (FILE:LINE), for errors

    def repeat(self, k: int) -> Rows:
        """Each row k times in a row: the rows of k responses per prompt (a group is contiguous)."""
        rep = lambda xs: [x for x in xs for _ in range(k)]  # noqa: E731
        return Rows(rep(self.prompts), {c: rep(v) for c, v in self.columns.items()}, rep(self.origins))

    def take(self, indices: list[int]) -> Rows:
        pick = lambda xs: [xs[i] for i in indices]  # noqa: E731
        return Rows(pick(self.prompts), {c: pick(v) for c, v in self.columns.items()}, pick(self.origins))


def prompt_rows(split: Any) -> Rows:
    """The unique prompts of a phase-3 split (first occurrence: a reweighted split repeats rows) with their
    columns: the union of every row's fields, None where a row has no such field."""
    first: dict[str, int] = {}
    for i, prompt in enumerate(split["prompt"]):
        first.setdefault(prompt, i)
    order = list(first.values())
    names = split.column_names
    raw = split["columns"] if "columns" in names else [None] * len(split)
    fields = [json.loads(raw[i]) if raw[i] else {} for i in order]
    keys = sorted({k for f in fields for k in f})
    origins = split["origin"] if "origin" in names else [f"row {i + 1}" for i in range(len(split))]
    return Rows(list(first), {k: [f.get(k) for f in fields] for k in keys}, [origins[i] for i in order])
