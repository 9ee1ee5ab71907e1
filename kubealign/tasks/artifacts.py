"""The hand-off to KFP: what a component does with a stage's result once its task function returned.

The library never imports kfp: the component passes its Output artifacts in, and these functions use only
what every KFP artifact has (`path`, `metadata`, `log_metric`) or write plain files at the artifacts' paths
(the evaluation report, the leaderboard, the judge's verdict).
"""

from __future__ import annotations

import base64
import html
import json
import math
import shutil
from pathlib import Path
from typing import Any

from kubealign.outputs import read_result


def to_kfp(result: dict[str, Any], metrics: Any, artifact: Any) -> None:
    """Hand a stage result to KFP: numeric metrics into the Metrics artifact (the UI's metrics table)
    and onto the output artifact's metadata, with the stage name."""
    # only finite numbers: KFP's metadata is protobuf JSON, which has no NaN (a pull with nothing decided has no
    # win-rate: NaN in result.json, absent here)
    numeric = {
        k: float(v) for k, v in result.get("metrics", {}).items() if isinstance(v, int | float) and math.isfinite(v)
    }
    for key, value in numeric.items():
        metrics.log_metric(key, value)
    artifact.metadata.update({"stage": result.get("stage", ""), **numeric})
    persist(metrics)


def persist(*artifacts: Any) -> None:
    """Write metadata-only artifacts (Metrics, ClassificationMetrics) to their path as JSON.

    KFP keeps their content in metadata and never writes a file, and kfp.local's cache treats an
    artifact without a file as missing, so every rerun would miss the cache. A file also gives the
    artifact store a copy of the numbers."""
    for artifact in artifacts:
        path = Path(artifact.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(artifact.metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def roc(reward_dir: str) -> tuple[list[float], list[float], list[float], list[list[int]]]:
    """(fpr, tpr, thresholds, confusion matrix) of the RM's held-out pairs, for a KFP ClassificationMetrics.

    The ROC treats every response alone (label: was it the chosen one). The confusion matrix is pairwise,
    which is what a reward model is trained for: in each pair the higher-scored response is predicted
    "chosen", so rows [rejected, chosen] x predicted [rejected, chosen] hold accuracy on the diagonal.
    """
    scores = json.loads((Path(reward_dir) / "eval_scores.json").read_text(encoding="utf-8"))
    labels, values = scores["labels"], scores["scores"]
    half = len(labels) // 2  # chosen scores first, then the rejected ones in the same pair order
    right = sum(c > r for c, r in zip(values[:half], values[half:], strict=True))
    matrix = [[right, half - right], [half - right, right]]
    # sklearn's first threshold is +inf, stored as null; KFP wants finite numbers
    top = max(values) + 1.0
    thresholds = [top if t is None else t for t in scores["thresholds"]]
    return scores["fpr"], scores["tpr"], thresholds, matrix


def write_report(evaluation_dir: str, html_path: str, markdown_path: str) -> None:
    """One self-contained HTML page (the samples table with the plots inlined as data: URIs, since the
    KFP UI shows a single file) and the Markdown sample table."""
    directory = Path(evaluation_dir)
    page = (directory / "samples.html").read_text(encoding="utf-8")
    images = "".join(
        f"<h2>{png.stem.replace('_', ' ')}</h2><img alt='{png.stem}' "
        f"src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'>\n"
        for png in sorted(directory.glob("*.png"))
    )
    Path(html_path).parent.mkdir(parents=True, exist_ok=True)
    Path(html_path).write_text(page.replace("</body>", images + "</body>"), encoding="utf-8")
    shutil.copyfile(directory / "samples.md", markdown_path)


def write_leaderboard(comparison_dir: str, markdown_path: str, html_path: str) -> None:
    """The comparison's leaderboard as the KFP Markdown and HTML artifacts."""
    for name, target in (("leaderboard.md", markdown_path), ("frontier.html", html_path)):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(comparison_dir) / name, target)


def judge_report(judgement_dir: str, markdown_path: str) -> None:
    """judge.md as the KFP Markdown artifact (the reason there was nothing to judge, when there was not)."""
    source = Path(judgement_dir) / "judge.md"
    text = source.read_text(encoding="utf-8") if source.is_file() else f"# {read_result(Path(judgement_dir))['why']}\n"
    Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
    Path(markdown_path).write_text(text, encoding="utf-8")


def rounds_report(feedback_dir: str, html_path: str) -> None:
    """The feedback task's picture across rounds as one self-contained page for the KFP UI (the table, the PNG
    inlined as a data: URI); a line saying why there is none before people decided a served pair."""
    directory = Path(feedback_dir)
    png, table = directory / "rounds.png", directory / "rounds.md"
    if png.is_file():
        image = base64.b64encode(png.read_bytes()).decode()
        shown = html.escape(table.read_text(encoding="utf-8"))
        body = f"<pre>{shown}</pre><img alt='rounds' src='data:image/png;base64,{image}'>"
    else:
        body = "<p>No pair served by a round's canary has been decided by people yet: no round to show.</p>"
    Path(html_path).parent.mkdir(parents=True, exist_ok=True)
    Path(html_path).write_text(f"<html><body><h1>People across rounds</h1>{body}</body></html>\n", encoding="utf-8")


def held_aliases(promote_result: dict[str, Any]) -> str:
    """The registry aliases the new version holds after promotion, e.g. "challenger,champion"."""
    version = promote_result["version"]
    return ",".join(sorted(a for a, v in promote_result["aliases"].items() if v == version))
