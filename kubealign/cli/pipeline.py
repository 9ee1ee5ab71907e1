"""The pipeline commands of `kubealign`, each its parser beside its handler: run (the whole DAG here, through
kfp.local), compile (KFP IR YAML), submit and upload (to a Kubeflow Pipelines API) and rerun (one stage of an
earlier run on its artifacts). kubealign.pipelines does the work."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_set_option
from kubealign.errors import UserError
from kubealign.shape import ACT, JUDGE, ROUTES, SERVE, SHARED


def add_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="the whole DAG on this machine through kfp.local (the embedded default: tiny models, synthetic data)",
        description="Run data-split -> sft || reward -> ppo -> evaluate -> promote as the KFP pipeline, each task a "
        "subprocess (kfp.local SubprocessRunner), tracking to a local MLflow store (or $MLFLOW_TRACKING_URI). "
        "Ctrl-C stops every task (a training stage saves a checkpoint first) and exits 130; `--cache` then reuses "
        "what finished.",
    )
    _add_pipeline_config(run)
    run.add_argument("--output", type=Path, default=Path("runs/demo"), metavar="DIR", help="default: runs/demo")
    run.add_argument(
        "--cache",
        action="store_true",
        help="reuse tasks whose inputs are unchanged from any earlier run (kfp.local's cache, which every run "
        "fills, with or without --cache)",
    )
    run.add_argument(
        "--runner",
        choices=["subprocess", "docker"],
        default="subprocess",
        help="subprocess (default): each task a process of this Python environment; docker: each task in the "
        "CPU image (make images) through kfp.local's DockerRunner",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="stream every task's output as kfp.local does (default: one line per task; full output in DIR/logs/)",
    )
    run.set_defaults(func=run_command)

    compile_ = sub.add_parser("compile", help="write the pipeline as KFP IR YAML (for the UI or kfp.Client)")
    _add_pipeline_config(compile_)
    compile_.add_argument("-o", "--output", type=Path, default=Path("pipeline.yaml"), metavar="FILE")
    compile_.set_defaults(func=compile_command)

    submit = sub.add_parser("submit", help="compile and start a run on a Kubeflow Pipelines API (kfp.Client)")
    _add_pipeline_config(submit)
    submit.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint, e.g. http://localhost:8080")
    submit.add_argument("--experiment", help="KFP experiment (default: tracking.experiment)")
    submit.add_argument("--run-name", help="run name (default: kubealign-<timestamp>)")
    submit.add_argument("--namespace", help="profile namespace on multi-user Kubeflow")
    submit.add_argument("--no-cache", action="store_true", help="run every task even if KFP has a cached result")
    submit.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")
    submit.add_argument(
        "--no-parent-run", action="store_true", help="do not create a parent MLflow run for the pipeline run"
    )
    submit.set_defaults(func=submit_command)

    upload = sub.add_parser("upload", help="compile and upload the pipeline to KFP (new pipeline or new version)")
    _add_pipeline_config(upload)
    upload.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint")
    upload.add_argument(
        "--pipeline-name", default="kubealign-rlhf", help="pipeline name in KFP (default: kubealign-rlhf)"
    )
    upload.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")
    upload.set_defaults(func=upload_command)
    _add_rerun(sub)
    _add_reproduce(sub)


def _add_rerun(sub: Any) -> None:
    rerun = sub.add_parser("rerun", help="rerun one stage (and optionally its downstream) on an earlier run's outputs")
    rerun.add_argument(
        "stage",
        metavar="STAGE",
        help=f"a stage ({', '.join([*SHARED, *ROUTES, 'evaluate', 'promote', SERVE, JUDGE, ACT])}; {ACT}: the "
        "judge's verdict carried out again, which finishes one carried out halfway); in a run comparing several "
        "candidates, a candidate's name (its training, evaluation, then the comparison and the promotions) or compare",
    )
    rerun.add_argument(
        "--from", dest="run", required=True, type=Path, metavar="RUN_DIR", help="--output of an earlier `kubealign run`"
    )
    rerun.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field of that run's config (repeatable)",
    )
    rerun.add_argument("--downstream", action="store_true", help="also rerun every stage that depends on it")
    rerun.add_argument("--output", type=Path, metavar="DIR", help="default: RUN_DIR-rerun-STAGE-<timestamp>")
    rerun.set_defaults(func=rerun_command)


def _add_reproduce(sub: Any) -> None:
    reproduce = sub.add_parser(
        "reproduce",
        help="make a registered version again from its provenance manifest and compare the weights",
        description="Rerun the whole DAG of NAME version VERSION from the recipe its provenance manifest records "
        "(the same resolved config; refused in one line when a data source's content changed), through kfp.local "
        "into DIR with DIR's own MLflow store (nothing is registered in the registry the version came from), then "
        "compare the weight files made against the manifest's digests. Exit 0: identical; 1: they differ (the "
        "largest parameter difference and the evaluation figures side by side are printed and written to "
        "DIR/reproduce.json).",
    )
    reproduce.add_argument("name", metavar="NAME", help="the registered model, e.g. kubealign-actor")
    reproduce.add_argument("version", metavar="VERSION", help="its version number")
    reproduce.add_argument(
        "--tracking-uri", metavar="URI", help="the registry holding it (default: $MLFLOW_TRACKING_URI)"
    )
    reproduce.add_argument("--output", type=Path, metavar="DIR", help="default: runs/reproduce/NAME-VERSION")
    reproduce.set_defaults(func=reproduce_command)


def reproduce_command(args: argparse.Namespace) -> None:
    import os

    from kubealign.cli.summary import summarize
    from kubealign.pipelines import local
    from kubealign.pipelines.reproduce import lines, reproduce
    from kubealign.tracking.runs import check_uri

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("reproduce: give --tracking-uri (or set MLFLOW_TRACKING_URI) to the registry holding NAME")
    check_uri(uri, "--tracking-uri")
    output = args.output or Path("runs/reproduce") / f"{args.name}-{args.version}"
    try:
        report = reproduce(args.name, args.version, uri, output)
    except local.PipelineFailed as exc:
        raise UserError(str(exc)) from None
    except local.RunInterrupted as exc:
        sys.stderr.write(f"{exc}\n")
        raise SystemExit(130) from None
    print()
    print("\n".join(summarize(output)))
    print()
    print("\n".join(lines(report)))
    if not report["identical"]:
        raise SystemExit(1)


def _add_pipeline_config(parser: argparse.ArgumentParser) -> None:
    """The pipeline commands take the config as a positional (`kubealign run [CONFIG]`) or as --config, the
    stage commands' spelling (`kubealign run --config tiny-cpu-verifiable`), plus --set."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="YAML file or preset (default: tiny-cpu)")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same as the positional CONFIG")
    add_set_option(parser)


def run_command(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize
    from kubealign.config import load_config
    from kubealign.pipelines import local

    config = getattr(args, "config_object", None) or load_config(args.config, args.overrides)  # round next's
    try:
        index = local.run(config, args.output, caching=args.cache, verbose=args.verbose, runner=args.runner)
    except local.PipelineFailed as exc:
        raise UserError(str(exc)) from None
    except local.RunInterrupted as exc:
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        raise SystemExit(130) from None
    print()
    print("\n".join(summarize(args.output)))
    mlflow = index["mlflow"]
    print(f"\npipeline run: {index['wall_time_s']:.0f} s; artifacts indexed in {args.output.resolve() / 'run.json'}")
    print(f"task logs: {args.output.resolve() / local.LOGS_DIR}/<task>.log")
    print(f"MLflow: parent run {mlflow['parent_run_id']} in {mlflow['tracking_uri']}")
    if mlflow["tracking_uri"].startswith("sqlite:"):
        print(f"  open the UI: mlflow ui --backend-store-uri {mlflow['tracking_uri']}")


def compile_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import compile_pipeline

    path = compile_pipeline(load_config(args.config, args.overrides), args.output)
    print(f"compiled pipeline -> {path}")


def submit_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import submit

    result = submit(
        load_config(args.config, args.overrides),
        args.host,
        args.experiment,
        args.run_name,
        args.namespace,
        enable_caching=not args.no_cache,
        token=args.token,
        parent_run=not args.no_parent_run,
    )
    print(f"submitted run {result['run_name']} ({result['run_id']}): {result['url']}")
    if result["mlflow_parent_run_id"]:
        print(f"MLflow parent run: {result['mlflow_parent_run_id']}")


def upload_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import upload

    result = upload(load_config(args.config, args.overrides), args.host, args.pipeline_name, token=args.token)
    print(f"uploaded {args.pipeline_name} version {result['version']} (pipeline id {result['pipeline_id']})")


def rerun_command(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize
    from kubealign.pipelines.rerun import rerun

    index = rerun(args.stage, args.run, args.overrides, downstream=args.downstream, output=args.output)
    out = Path(index["stages"][index["rerun"][0]]["dir"]).parent
    print(f"reran {', '.join(index['rerun'])}; reused {', '.join(index['reused']) or 'nothing'} from {args.run}")
    print("\n".join(summarize(out)))
    print(f"\nrerun written to {out.resolve()}; artifacts indexed in {out.resolve() / 'run.json'}")
