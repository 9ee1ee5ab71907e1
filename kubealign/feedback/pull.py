"""A pull of people's choices, shared by `kubealign feedback pull` and the pipeline's `feedback` task:
the project's export -> the preference rows written atomically as a .jsonl file data-split reads, the summary
lines, and a `feedback` MLflow run whose dataset input is the file (its sha256, the project, the versions
compared, the annotators) so that the next reward model's lineage leads back to the choices behind it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from kubealign.errors import UserError
from kubealign.feedback.annotations import Pulled, pulled, wilson


class Written(NamedTuple):
    out: Pulled
    text: str  # the file's content
    metrics: dict[str, float]
    lines: list[str]  # the summary, as printed


def pull(client: Any, title: str, challenger: str, output: Path, shown: Path | None = None) -> Written:
    """The project's decided tasks as rows in `output` (a new .jsonl file, written atomically; an empty file
    when nothing is decided yet) and what they say of the two models. shown: the file's name in the summary
    (where `output` is a temporary place)."""
    project = client.find_project(title)
    if project is None:
        raise UserError(f"--project {title!r}: no such project at {client.url}")
    out = pulled(client.export(project), challenger)
    text = "".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in out.rows)
    write_atomically(output, text)
    low, high = wilson(out.challenger_wins, out.decided)
    rate = out.challenger_wins / out.decided if out.decided else float("nan")
    agreement = "n/a (no task with two votes)" if out.agreement is None else f"{out.agreement:.2f}"
    lines = [
        f"feedback: {shown or output}  ({len(out.rows)} rows from {out.decided} decided tasks)",
        f"  pending {out.pending}, skipped {out.skipped}, tied {out.tied}; annotators {len(out.annotators)}",
        f"  human win-rate of {challenger}: {rate:.2f} (95 % interval {low:.2f}-{high:.2f}); agreement {agreement}",
    ]
    metrics = {"rows": len(out.rows), "decided": out.decided, "pending": out.pending, "skipped": out.skipped}
    metrics.update(tied=out.tied, human_win_rate=rate, human_win_rate_low=low, human_win_rate_high=high)
    if out.agreement is not None:
        metrics["agreement"] = out.agreement
    return Written(out, text, metrics, lines)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def track(config: Any, written: Written, output: Path, title: str, url: str, challenger: str) -> None:
    """The `feedback` run: the file as its dataset input, the counts and win-rate as metrics, tagged with the
    challenger's version (what the online judge's canary.min_human_win_rate looks up: feedback.lookup)."""
    from kubealign.feedback.lookup import VERSION_TAG
    from kubealign.tracking.lineage import DatasetRef
    from kubealign.tracking.runs import stage_run

    out = written.out
    versions = sorted({r[k] for r in out.rows for k in ("chosen_by", "rejected_by") if r[k]})
    profile = {"rows": len(out.rows), "annotators": out.annotators, "versions": versions, "project": title}
    sha = hashlib.sha256(written.text.encode("utf-8")).hexdigest()
    ref = DatasetRef(output.name, sha, f"{url}/projects ({title})", "label-studio", "human-feedback", profile)
    with stage_run("feedback", config, output.resolve().parent, required=False) as tracker:
        tracker.log_inputs([ref])
        tracker.log_metrics(written.metrics)
        tags = {"kubealign.feedback.versions": ",".join(versions), "kubealign.feedback.file": str(output)}
        measured = sorted({v.split(":", 1)[1] for v in versions if v.split(":", 1)[0] == challenger})
        if len(measured) == 1:  # the version the win-rate is of
            tags[VERSION_TAG] = measured[0]
        tracker.set_tags(tags)
