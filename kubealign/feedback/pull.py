"""A pull of people's choices, shared by `kubealign feedback pull` and the pipeline's `feedback` task:
the project's export -> the preference rows written atomically as a .jsonl file data-split reads, the summary
lines, and a `feedback` MLflow run whose dataset input is the file (its sha256, the project, the versions
compared, the annotators) so that the next reward model's lineage leads back to the choices behind it.

With a registry (MLFLOW_TRACKING_URI, tracking.uri) every (registered model, version) a task names is looked up
in it before anything is written: a task that names a version the registry does not hold is refused, and only
then is the run tagged with the registered model and the challenger's version, what the online judge's people's
check reads (feedback.lookup). Without one (a local store of the run's own) the run carries neither tag."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kubealign.errors import UserError
from kubealign.feedback.agreement import by_version, decisions
from kubealign.feedback.annotations import Pulled, pulled, wilson
from kubealign.feedback.rounds import last_pushed


class Written(NamedTuple):
    out: Pulled
    text: str  # the file's content
    metrics: dict[str, float]
    lines: list[str]  # the summary, as printed
    registry: str | None = None  # where the tasks' models and versions were checked; None: not checked
    pushed: Any = None  # feedback.rounds.LastRound: the last round whose served pairs are in the project, or None


def pull(
    client: Any, title: str, challenger: str, output: Path, shown: Path | None = None, registry: str | None = None
) -> Written:
    """The project's decided tasks as rows in `output` (a new .jsonl file, written atomically; an empty file
    when nothing is decided yet) and what they say of the two models. shown: the file's name in the summary
    (where `output` is a temporary place); registry: the MLflow registry the tasks' claims are checked in (None:
    none). All of the pull's calls end within the client's deadline; nothing is written when anything fails."""
    client.start()
    project = client.find_project(title)
    if project is None:
        raise UserError(f"--project {title!r}: no such project at {client.url}")
    where = f"Label Studio at {client.url}: project {title!r}"
    export = client.export(project)
    try:
        out = pulled(export, challenger)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    if registry:
        check_registry(out.claims, registry, where)
    text = "".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in out.rows)
    write_atomically(output, text)
    low, high = wilson(out.challenger_wins, out.decided)
    rate = out.challenger_wins / out.decided if out.decided else float("nan")
    agreement = "n/a (no task with two votes)" if out.agreement is None else f"{out.agreement:.2f}"
    lines = [
        f"feedback: {shown or output}  ({len(out.rows)} rows from {out.decided} decided tasks)",
        f"  pending {out.pending}, skipped {out.skipped}, tied {out.tied}, duplicates {out.duplicates}; "
        f"annotators {len(out.annotators)}",
        f"  human win-rate of {challenger}: {rate:.2f} (95 % interval {low:.2f}-{high:.2f}); agreement {agreement}",
    ]
    metrics = {"rows": len(out.rows), "decided": out.decided, "pending": out.pending, "skipped": out.skipped}
    metrics.update(
        tied=out.tied, duplicates=out.duplicates, human_win_rate=rate, human_win_rate_low=low, human_win_rate_high=high
    )
    if out.agreement is not None:
        metrics["agreement"] = out.agreement
    served_figures(export, challenger, metrics, lines)
    for version, (rate_of, n) in by_version(decisions(export), challenger).items():
        metrics[f"human_win_rate_version_{version}"], metrics[f"decided_version_{version}"] = rate_of, n
    return Written(out, text, metrics, lines, registry, last_pushed(export))


def served_figures(export: Any, challenger: str, metrics: dict[str, float], lines: list[str]) -> None:
    """Of tasks pushed from what was served (feedback.served): each judge's agreement with people, and the
    challenger's weighted win-rate over all and per round, added to `metrics` and `lines` (nothing for other tasks);
    each judge's agreement on each round's pairs alone as round_N/agreement_<judge> (_low, _high, _n)."""
    from kubealign.feedback import agreement

    decided = agreement.decisions(export)
    found = agreement.agreements(decided)
    metrics.update(agreement.figures(found))
    lines += agreement.lines(found)
    rounds = sorted({m["round"] for m, _ in decided if isinstance(m.get("round"), int)})
    for number in [None, *rounds] if rounds else []:
        these = [(m, c) for m, c in decided if number is None or m.get("round") == number]
        if number is not None:  # each judge on that round's pairs alone: the picture across rounds (feedback_report)
            per = agreement.figures(agreement.agreements(these))
            metrics.update({f"round_{number}/{k}": v for k, v in per.items()})
        rate = agreement.weighted_win_rate(these, challenger)
        if rate is None:
            continue
        name = "human_win_rate_weighted" + ("" if number is None else f"_round_{number}")
        metrics[name] = rate
        said = "all rounds" if number is None else f"round {number}"
        lines.append(f"  weighted human win-rate of {challenger} ({said}, {len(these)} decided): {rate:.2f}")


def check_registry(claims: dict[tuple[str | None, str], str], uri: str, where: str) -> None:
    """Each (registered model, version) the tasks name (claims: where a task first names it) is a version in the
    registry at `uri`; one line naming the task otherwise."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import error_code, registry_errors

    with registry_errors(uri):
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        for (model, version), said in claims.items():
            if model is None:
                raise UserError(
                    f"{where}: the export: {said.split(':')[0]}: meta.kubealign.registered_model is missing (push "
                    f"writes it): the task's models cannot be checked against the registry at {uri}"
                )
            try:
                client.get_model_version(model, version)
            except MlflowException as exc:
                if error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
                    raise
                raise UserError(
                    f"{where}: the export: {said}: the registry at {uri} has no version {version} of {model!r}"
                ) from None


def write_atomically(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all: written to a fresh name of its own in the same directory (created
    exclusively, never through a link someone left there), then renamed into place."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    except OSError as exc:
        raise UserError(f"--output {path}: {exc.strerror}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except OSError as exc:
        raise UserError(f"--output {path}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def track(
    config: Any, written: Written, output: Path, title: str, url: str, challenger: str, files: Sequence[Path] = ()
) -> None:
    """The `feedback` run: the file as its dataset input, the counts and win-rate as metrics; where the registry
    vouched for the tasks' claims (pull's `registry`), tagged with the registered model and the challenger's version
    (what the online judge's canary.min_human_win_rate looks up: feedback.lookup); `files` logged as its artifacts."""
    from kubealign.feedback.lookup import AGREEMENT_TAG, MODEL_TAG, VERSION_TAG
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
        models = {model for model, _ in out.claims}
        judged = any(k.startswith("agreement_") for k in written.metrics) and written.registry and len(models) == 1
        if judged:  # the judges' agreement with people, of this registered model (promote.guards.min_judge_agreement)
            tags[AGREEMENT_TAG] = next(iter(models))
        if written.registry and len(models) == 1:  # whose versions its per-version win-rates are (feedback.lookup)
            tags[MODEL_TAG] = next(iter(models))
            if len(measured) == 1:  # the version human_win_rate is of
                tags[VERSION_TAG] = measured[0]
        tracker.set_tags(tags)
        for path in files:  # the feedback stage's picture across rounds
            tracker.log_artifact(path, "feedback")
