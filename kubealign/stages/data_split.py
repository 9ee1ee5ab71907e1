"""Stage 0, data-split: sources -> normalized, validated, deduplicated rows -> three phase datasets.

Output (appears atomically in --output DIR):
  DIR/phase1_sft, DIR/phase2_reward, DIR/phase3_prompts   datasets save_to_disk dirs, splits train/eval,
                                                          columns prompt, chosen, rejected, columns, source,
                                                          origin (chosen None: a prompt-only phase-3 row)
  DIR/manifest.json   counts per phase and split, sha256 per phase and per source, config hash, cache
                      key, drop report (count and first locations per reason), skipped malformed rows
  DIR/result.json     metrics and produced paths

The cache key is the sha256 of the data config AND the sources' content: the same config on the same
bytes reuses DIR ("cache hit"); a one-row edit recomputes. (DeepSpeed-Chat keys on config strings only,
so an edited file silently reuses stale splits.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kubealign import __version__
from kubealign.config import KubealignConfig, section_sha256
from kubealign.config.schema import DataConfig
from kubealign.data.schemas import RowDrop, RowError, normalize, row_problem
from kubealign.data.sources import SourceRead, declared_columns, read_source
from kubealign.data.split import PHASES, SplitPlan, split_rows
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_json, write_result
from kubealign.tracking import lineage
from kubealign.tracking.runs import stage_run

STAGE = "data-split"
log = logging.getLogger(__name__)
# Bump when the output layout or the split rules change: it is part of the cache key. 3: prompt_completion
# rows feed SFT, answer-like prompt-only fields are refused unless declared.
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
# columns: a prompt-only row's other fields as a JSON object (the reward functions' columns); None otherwise
COLUMNS = ("prompt", "chosen", "rejected", "columns", "source", "origin")


@dataclass
class Report:
    """Rows dropped (by reason) and malformed rows skipped, with their first locations."""

    max_examples: int
    dropped: dict[str, dict[str, Any]] = field(default_factory=dict)
    invalid: dict[str, Any] = field(default_factory=lambda: {"count": 0, "examples": []})

    def drop(self, reason: str, origin: str) -> None:
        entry = self.dropped.setdefault(reason, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < self.max_examples:
            entry["examples"].append(origin)

    def skip(self, origin: str, message: str) -> None:
        self.invalid["count"] += 1
        if len(self.invalid["examples"]) < self.max_examples:
            self.invalid["examples"].append({"where": origin, "error": message})


def cache_key(data: DataConfig, sources: list[SourceRead]) -> str:
    payload = {
        "format_version": FORMAT_VERSION,
        "config_sha256": section_sha256(data),
        "sources": [s.sha256 for s in sources],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def clean_rows(data: DataConfig, sources: list[SourceRead], report: Report) -> list[dict[str, Any]]:
    """Normalize every record, raise or skip malformed ones, drop unusable rows and exact duplicates."""
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str | None, str | None, str | None]] = set()
    total = sum(len(s.records) for s in sources)
    bar = tqdm(total=total, desc="normalize", unit="row", leave=False, delay=1.0)
    for config_source, source in zip(data.sources, sources, strict=True):
        declared = declared_columns(config_source)
        for record in source.records:
            bar.update()
            try:
                if record.error:
                    raise RowError(None, record.error)
                pair = normalize(record.value, config_source.format, declared)
            except RowError as exc:
                if data.on_error == "raise":
                    raise UserError(f"{record.origin}: {exc.describe()}") from None
                report.skip(record.origin, exc.describe())
                continue
            except RowDrop as exc:
                report.drop(exc.reason, record.origin)
                continue
            problem = row_problem(pair)
            if problem is None and pair in seen:
                problem = "duplicate"
            if problem:
                report.drop(problem, record.origin)
                continue
            seen.add(pair)
            rows.append({**pair._asdict(), "source": source.label, "origin": record.origin})
    bar.close()
    return rows


def phase_sha256(splits: dict[str, list[dict[str, Any]]]) -> str:
    """Content hash of a phase: its rows' (prompt, chosen, rejected), split by split, in order."""
    digest = hashlib.sha256()
    for split in splits:  # train, eval (and phase 2's heldout): a phase without heldout hashes as before
        digest.update(f"[{split}]\n".encode())
        for row in splits[split]:
            digest.update(json.dumps([row["prompt"], row["chosen"], row["rejected"]], ensure_ascii=False).encode())
            digest.update(b"\n")
    return digest.hexdigest()


def save_phases(plan: SplitPlan, directory: Path) -> dict[str, Any]:
    """Write each phase as a datasets DatasetDict (train/eval); return the manifest's phase entries."""
    import datasets

    datasets.disable_progress_bars()  # ours already show progress; one bar per arrow shard is noise
    features = datasets.Features({c: datasets.Value("string") for c in COLUMNS})
    entries: dict[str, Any] = {}
    for phase in tqdm(PHASES, desc="save phases", unit="phase", leave=False, delay=1.0):
        splits = plan.phases[phase]
        dataset = datasets.DatasetDict(
            {
                split: datasets.Dataset.from_dict(
                    {c: [row[c] for row in splits[split]] for c in COLUMNS}, features=features
                )
                for split in splits
            }
        )
        # An empty split saved with the default (zero) shards cannot be loaded back (datasets 5.2), so
        # empty splits get one empty shard.
        empty = {split: 1 for split in splits if not splits[split]}
        dataset.save_to_disk(str(directory / phase), num_shards=empty)
        entries[phase] = {
            "path": phase,
            "sha256": phase_sha256(splits),
            "files_sha256": files_sha256(directory / phase),
            "splits": {split: {"rows": len(splits[split]), "prompts": plan.prompts[phase][split]} for split in splits},
        }
    return entries


def metrics_of(manifest: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {
        "rows_read": manifest["rows"]["read"],
        "rows_kept": manifest["rows"]["kept"],
        "rows_dropped": sum(d["count"] for d in manifest["dropped"].values()),
        "rows_invalid": manifest["invalid"]["count"],
    }
    for phase, entry in manifest["phases"].items():
        for split, counts in entry["splits"].items():
            metrics[f"{phase}_{split}_rows"] = counts["rows"]
            metrics[f"{phase}_{split}_prompts"] = counts["prompts"]
    return metrics


def outputs_of() -> dict[str, str]:
    return {"manifest": MANIFEST, **{phase: phase for phase in PHASES}}


def files_sha256(phase_dir: Path) -> str:
    """sha256 of the files save_to_disk wrote for one phase. `datasets` may later add cache-*.arrow
    files beside them when a stage maps over the loaded data; those are not part of the phase."""
    from kubealign.outputs import tree_sha256

    return tree_sha256(phase_dir, skip=lambda rel: Path(rel).name.startswith("cache-"))


def _cached(output: Path, key: str) -> dict[str, Any] | None:
    """The manifest of a previous split with this cache key whose phase files are intact, else None.
    A cache hit hands these files to training: a phase edited or corrupted since it was written (its
    files no longer match the manifest's sha256) is rebuilt from the sources, with a warning."""
    try:
        manifest = json.loads((output / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("cache_key") != key or not all((output / p).is_dir() for p in PHASES):
        return None
    for phase in PHASES:
        expected = manifest.get("phases", {}).get(phase, {}).get("files_sha256")
        if expected is None:  # written before the manifest held file hashes: nothing to verify against
            log.warning("data-split: %s has no file sha256 in its manifest; rebuilding", output / phase)
            return None
        if files_sha256(output / phase) != expected:
            log.warning(
                "data-split: %s does not match its manifest's sha256 (changed since written); rebuilding",
                output / phase,
            )
            return None
    return manifest


def build(config: KubealignConfig, sources: list[SourceRead], key: str, output: Path) -> dict[str, Any]:
    """Clean, split and write everything into `output` atomically; return the manifest."""
    data = config.data
    report = Report(data.report_examples)
    rows = clean_rows(data, sources, report)
    if not rows:
        read = sum(len(s.records) for s in sources)
        reasons = ", ".join(f"{r} {e['count']}" for r, e in sorted(report.dropped.items()))
        skipped = f", skipped malformed {report.invalid['count']}" if report.invalid["count"] else ""
        raise UserError(f"data.sources: no usable rows ({read} read; dropped: {reasons or 'none'}{skipped})")
    weights = {s.label: c.weight for c, s in zip(data.sources, sources, strict=True)}
    rewarded = {s.label for c, s in zip(data.sources, sources, strict=True) if c.phase == "reward"}
    to_reward = frozenset(r["prompt"] for r in rows if r["source"] in rewarded and r["rejected"] is not None)
    ratios, fraction, seed = data.split_ratios, data.eval_fraction, data.seed
    people = (data.people_check_fraction, frozenset(rewarded))
    plan = split_rows(rows, ratios, fraction, seed, weights, data.heldout_reward_fraction, to_reward, *people)
    for reason, row in plan.dropped:
        report.drop(reason, row["origin"])
    total = sum(data.split_ratios)
    manifest: dict[str, Any] = {
        "kubealign_version": __version__,
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "config_sha256": section_sha256(data),
        "config": data.model_dump(mode="json"),
        "ratios": [r / total for r in data.split_ratios],
        "sources": [
            {"path": s.label, "kind": s.kind, "sha256": s.sha256, "rows_read": len(s.records)} for s in sources
        ],
        "rows": {"read": sum(len(s.records) for s in sources), "kept": len(rows)},
        "dropped": report.dropped,
        "invalid": report.invalid,
    }
    with atomic_dir(output) as tmp:
        manifest["phases"] = save_phases(plan, tmp)
        write_json(tmp / MANIFEST, manifest)
        write_result(tmp, STAGE, metrics_of(manifest), outputs_of(), cache_hit=False)
    return manifest


def run(config: KubealignConfig, output: Path, force: bool = False) -> dict[str, Any]:
    """Run the data-split stage; returns the result.json payload (with `cache_hit`)."""
    check_output_path(output, STAGE)
    started = time.perf_counter()
    with stage_run(STAGE, config, output.resolve().parent) as tracker:
        sources = [read_source(i, s, config.data) for i, s in enumerate(config.data.sources)]
        key = cache_key(config.data, sources)
        manifest = None if force else _cached(output, key)
        cache_hit = manifest is not None
        if manifest is None:
            manifest = build(config, sources, key, output)
        result = read_result(output)
        result.update(cache_hit=cache_hit, wall_time_s=round(time.perf_counter() - started, 3))
        write_json(output / "result.json", result)
        tracker.set_tags({"kubealign.cache_hit": str(cache_hit).lower(), "kubealign.data_key": key})
        tracker.log_inputs(lineage.source_refs(manifest))  # each source it read: name, digest, rows
        tracker.log_metrics(result["metrics"])
        tracker.log_artifact(output / MANIFEST, "data-split")
        result["tracking_uri"] = tracker.tracking_uri
        result["run_id"] = tracker.run_id
    result["output"] = str(output)
    return result
