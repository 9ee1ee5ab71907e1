"""Read data sources into raw records that remember where they came from (file:line).

A source is 'synthetic', 'synthetic-arithmetic' or 'synthetic-tool-arithmetic' (built-in generators), a
local file (.jsonl, .jsonl.gz, .json, .parquet), a datasets save_to_disk dir, a local dataset dir, or a hub
dataset name; the last two go through datasets.load_dataset, the same code path a hub download takes.
Problems with a whole source (missing, not gzip, not parquet) are UserErrors; problems with one line (bad
UTF-8, bad JSON) become records carrying an error, so the stage can raise or skip them per `data.on_error`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from kubealign.config.schema import DataConfig, DataSource
from kubealign.data import arithmetic, synthetic, tool_arithmetic
from kubealign.errors import UserError, first_line

BUILT_IN = ("synthetic", "synthetic-arithmetic", "synthetic-tool-arithmetic")  # generators, not files
# The generators' declared columns: synthetic-arithmetic's prompt rows carry the true sum as `answer`, the
# column its reward function reads (a user's file declares such fields in data.sources[i].columns).
BUILT_IN_COLUMNS = {"synthetic-arithmetic": frozenset({"answer"}), "synthetic-tool-arithmetic": frozenset({"answer"})}


def declared_columns(source: DataSource) -> frozenset[str]:
    """The fields a source's prompt-only rows keep as columns whatever their names (schemas.normalize)."""
    return frozenset(source.columns) | BUILT_IN_COLUMNS.get(source.path, frozenset())


FILE_KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".json": "json", ".parquet": "parquet"}


class RawRecord(NamedTuple):
    origin: str  # "file:line", "file:item N", "name[split]:row N"
    value: Any  # the parsed row (None when `error` is set)
    error: str | None  # a read-level problem (bad UTF-8 / JSON) on this line


class SourceRead(NamedTuple):
    label: str  # the path as configured
    kind: str  # synthetic | jsonl | jsonl.gz | json | parquet | disk | dataset
    sha256: str  # content hash: file bytes, or canonical JSON of the rows
    records: list[RawRecord]


def _file_kind(path: str) -> str | None:
    lower = path.lower()
    for suffix in sorted(FILE_KINDS, key=len, reverse=True):
        if lower.endswith(suffix):
            return FILE_KINDS[suffix]
    return None


def _rows_sha256(rows: list[Any]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _jsonl_records(label: str, data: bytes, limit: int | None) -> list[RawRecord]:
    records: list[RawRecord] = []
    lines = data.split(b"\n")
    for lineno, line in enumerate(tqdm(lines, desc=f"read {Path(label).name}", unit="line", leave=False, delay=1.0), 1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        origin = f"{label}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1})"
            records.append(RawRecord(origin, None, bad))
            continue
        try:
            records.append(RawRecord(origin, json.loads(text), None))
        except json.JSONDecodeError as exc:
            records.append(RawRecord(origin, None, f"invalid JSON: {exc.msg} (column {exc.colno})"))
    return records


def _read_file(label: str, path: Path, kind: str, limit: int | None) -> SourceRead:
    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if kind == "jsonl.gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{label}: not a valid gzip file ({first_line(exc)})") from None
    if kind in ("jsonl", "jsonl.gz"):
        return SourceRead(label, kind, sha, _jsonl_records(label, raw, limit))
    if kind == "json":
        try:
            items = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise UserError(f"{label}: not valid UTF-8 (byte offset {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{label}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
        if not isinstance(items, list):
            raise UserError(f"{label}: expected a JSON list of rows, got {type(items).__name__}")
        items = items[:limit] if limit else items
        return SourceRead(label, kind, sha, [RawRecord(f"{label}:item {i}", v, None) for i, v in enumerate(items, 1)])
    import pyarrow.parquet as pq  # parquet

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise UserError(f"{label}: not a readable parquet file ({first_line(exc)})") from None
    rows = rows[:limit] if limit else rows
    return SourceRead(label, kind, sha, [RawRecord(f"{label}:row {i}", v, None) for i, v in enumerate(rows, 1)])


def _dataset_records(label: str, dataset: Any, split: str, limit: int | None) -> list[RawRecord]:
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    rows = dataset.to_list()
    return [RawRecord(f"{label}[{split}]:row {i}", row, None) for i, row in enumerate(rows, 1)]


def _read_dataset(index: int, source: DataSource, path: Path | None) -> SourceRead:
    import datasets

    label, split = source.path, source.split
    try:
        if path is not None and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            kind, loaded = "disk", datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UserError(
                        f"data.sources[{index}].split: {label} has no split {split!r} (splits: {', '.join(loaded)})"
                    )
                loaded = loaded[split]
        else:
            kind = "dataset"
            loaded = datasets.load_dataset(str(path or label), name=source.name, split=split)
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types (not found, offline, bad split, ...)
        raise UserError(f"data.sources[{index}].path: cannot load dataset {label!r}: {first_line(exc)}") from None
    records = _dataset_records(label, loaded, split, source.limit)
    return SourceRead(label, kind, _rows_sha256([r.value for r in records]), records)


def read_source(index: int, source: DataSource, data: DataConfig) -> SourceRead:
    """Read one configured source (data.sources[index]) fully into raw records."""
    if source.path in BUILT_IN:
        if source.path == "synthetic":
            rows = synthetic.generate(data.synthetic_pairs, data.synthetic_sft_rows, data.seed)
            version = synthetic.VERSION
        else:  # the two arithmetic generators take the same settings
            generator = arithmetic if source.path == "synthetic-arithmetic" else tool_arithmetic
            rows = generator.generate(data.synthetic_prompts, data.synthetic_sft_rows, data.seed)
            version = generator.VERSION
        rows = rows[: source.limit] if source.limit else rows
        records = [RawRecord(f"{source.path}:row {i}", row, None) for i, row in enumerate(rows, 1)]
        return SourceRead(source.path, "synthetic", _rows_sha256([version, *rows]), records)
    path = Path(source.path).expanduser()
    kind = _file_kind(source.path)
    if path.is_file():
        if kind is None:
            raise UserError(
                f"data.sources[{index}].path: {source.path}: unsupported file type "
                f"(use {', '.join(FILE_KINDS)}, a dataset dir or a hub name)"
            )
        return nonempty(index, _read_file(source.path, path, kind, source.limit))
    if path.is_dir():
        return nonempty(index, _read_dataset(index, source, path))
    looks_local = kind is not None or source.path.startswith((".", "/", "~")) or source.path.count("/") > 1
    if looks_local:
        raise UserError(f"data.sources[{index}].path: no such file or directory: {source.path}")
    return nonempty(index, _read_dataset(index, source, None))


def nonempty(index: int, read: SourceRead) -> SourceRead:
    """A source that holds no row at all is a mistake (a wrong or truncated file), named as such: "no
    usable rows" over all sources would not say which one."""
    if not read.records:
        raise UserError(f"data.sources[{index}].path: {read.label} has no rows (an empty {read.kind} source)")
    return read
