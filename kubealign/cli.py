"""The `kubealign` command: one subcommand per stage, plus tiny-model and config.

Every stage command takes --config (a YAML file or a preset name; default: the tiny-cpu preset),
repeated --set section.key=value overrides, its input paths and --output DIR, and writes
DIR/result.json. Bad input exits with code 2 and one line naming the file, line or field.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.errors import Stopped, UserError
from kubealign.shape import ROUTES, SHARED


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file or preset name (default: the tiny-cpu preset, configs/tiny-cpu.yaml)",
    )
    _add_set_option(parser)


def _add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable); VALUE is YAML, e.g. --set data.split_ratios=[1,1,1]",
    )


def _add_pipeline_config(parser: argparse.ArgumentParser) -> None:
    """The pipeline commands take the config as a positional (`kubealign run [CONFIG]`) or as --config, the
    stage commands' spelling (`kubealign run --config tiny-cpu-verifiable`), plus --set."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="YAML file or preset (default: tiny-cpu)")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same as the positional CONFIG")
    _add_set_option(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubealign",
        description="RLHF (SFT, reward model, PPO with DeepSpeed's Hybrid Engine) as a Kubeflow pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"kubealign {__version__}")
    # The deepspeed launcher puts --local_rank=N right after the script name (torchrun sets LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    split = sub.add_parser(
        "data-split",
        help="stage 0: normalize, validate, deduplicate and split data into the three phases",
        description="Read data.sources, normalize rows to {prompt, chosen, rejected}, drop bad rows, split "
        "unique prompts into phase1_sft / phase2_reward / phase3_prompts and write a manifest.",
    )
    _add_config_options(split)
    split.add_argument(
        "--source",
        dest="sources",
        action="append",
        default=[],
        metavar="PATH",
        help="input file, dataset dir or hub name (repeatable); replaces data.sources",
    )
    split.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    split.add_argument("--force", action="store_true", help="recompute even when the cache key matches")

    for stage, phase, what in (
        ("sft", "phase1_sft", "stage 1: supervised fine-tuning on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("reward", "phase2_reward", "stage 2: reward model (Bradley-Terry) on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("dpo", "phase2_reward", "the dpo route: DPO from the SFT model on the preference pairs (ZeRO 0-3, LoRA)"),
    ):
        train = sub.add_parser(stage, help=what, description=what)
        _add_config_options(train)
        train.add_argument(
            "--data",
            required=True,
            type=Path,
            metavar="SPLIT_DIR",
            help=f"data-split output (or its {phase} dir)",
        )
        what_model = "policy to start from, the SFT output dir" if stage == "dpo" else "model to train"
        train.add_argument("--model", metavar="NAME_OR_DIR", help=f"{what_model} (default: {stage}.model)")
        train.add_argument("--output", required=True, type=Path, metavar="DIR", help="output model directory")
        _add_checkpoint_options(train)

    ppo = sub.add_parser(
        "ppo",
        help="stage 3: PPO with the DeepSpeed Hybrid Engine (actor, reference, critic, reward)",
        description="PPO (GRPO, RLOO: ppo.algorithm) on phase-3 prompts: actor and reference from the SFT dir, the "
        "score from the reward model (--reward, else --critic) and / or the reward functions of rewards.functions. "
        "The critic (ppo only): --critic, else the reward model, else the SFT model with a new value head.",
    )
    _add_config_options(ppo)
    ppo.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output (or phase3)")
    ppo.add_argument("--actor", required=True, type=Path, metavar="SFT_DIR", help="SFT model dir (actor + reference)")
    ppo.add_argument("--critic", type=Path, metavar="RM_DIR", help="critic start (ppo; default: the reward model)")
    ppo.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model (default: --critic; none: rewards.model_weight 0)"
    )
    ppo.add_argument("--output", required=True, type=Path, metavar="DIR", help="output actor directory")
    _add_functions_option(ppo)
    _add_checkpoint_options(ppo)

    evaluate = sub.add_parser(
        "evaluate",
        help="stage 4: compare the PPO candidate with the SFT baseline on held-out prompts",
        description="Sample baseline and candidate on phase-3 eval prompts with the same seed, score both with "
        "the reward model and / or the reward functions (rewards.functions; their means as fn/NAME/baseline and "
        "fn/NAME/candidate); win-rate, KL, lengths, perplexity, sample table and plots.",
    )
    _add_config_options(evaluate)
    evaluate.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output")
    evaluate.add_argument("--baseline", required=True, type=Path, metavar="SFT_DIR", help="baseline model dir")
    evaluate.add_argument("--candidate", required=True, type=Path, metavar="PPO_DIR", help="candidate model dir")
    evaluate.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model dir (none with rewards.model_weight 0)"
    )
    evaluate.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    _add_functions_option(evaluate)

    promote = sub.add_parser(
        "promote",
        help="stage 5: register the actor in the MLflow registry; move aliases if the gate passes",
        description="Register a model version (challenger); make it champion if it passes promote.* thresholds "
        "and beats the current champion. The old champion keeps previous-champion.",
    )
    _add_config_options(promote)
    promote.add_argument("--evaluation", required=True, type=Path, metavar="EVAL_DIR", help="evaluate stage output")
    promote.add_argument("--model-dir", required=True, type=Path, metavar="PPO_DIR", help="the evaluated candidate")
    promote.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory (result.json)")
    rollback = sub.add_parser("rollback", help="move the champion alias back to previous-champion")
    _add_config_options(rollback)

    run = sub.add_parser(
        "run",
        help="the whole DAG on this machine through kfp.local (the embedded default: tiny models, synthetic data)",
        description="Run data-split -> sft || reward -> ppo -> evaluate -> promote as the KFP pipeline, each task a "
        "subprocess (kfp.local SubprocessRunner), tracking to a local MLflow store (or $MLFLOW_TRACKING_URI).",
    )
    _add_pipeline_config(run)
    run.add_argument("--output", type=Path, default=Path("runs/demo"), metavar="DIR", help="default: runs/demo")
    run.add_argument("--cache", action="store_true", help="reuse tasks whose inputs are unchanged (kfp.local cache)")
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

    images_ = sub.add_parser("images", help="build the container images offline; a private Docker daemon for them")
    images_sub = images_.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    build = images_sub.add_parser(
        "build",
        help="build an image from a wheelhouse of the lock, with no network inside the build",
        description="Makes (once per lock) a wheelhouse of the locked dependencies, stages it with the image's "
        "Dockerfile and builds with --no-index and no network. Uses $DOCKER_HOST, else kubealign's daemon "
        "(`kubealign images daemon start`), else /var/run/docker.sock.",
    )
    build.add_argument("--image", choices=["cpu", "train"], default="cpu", help="which image (default: cpu)")
    build.add_argument(
        "--base",
        default="auto",
        metavar="auto|bootstrap|IMAGE",
        help="base of either image: auto (the Python image if it can be had, else bootstrap), bootstrap (Debian "
        "bookworm made here with debootstrap) or an image the daemon has (Python 3.11 with venv, headers, g++)",
    )
    build.add_argument(
        "--cuda-arch-list",
        metavar="ARCHS",
        help="train image: TORCH_CUDA_ARCH_LIST to compile DeepSpeed's ops for (default: the Dockerfile's "
        "'8.0;8.6;8.9;9.0'; each arch adds build time)",
    )
    daemon_ = images_sub.add_parser("daemon", help="start, stop or show kubealign's private dockerd")
    daemon_.add_argument("action", choices=["start", "stop", "status"])

    compile_ = sub.add_parser("compile", help="write the pipeline as KFP IR YAML (for the UI or kfp.Client)")
    _add_pipeline_config(compile_)
    compile_.add_argument("-o", "--output", type=Path, default=Path("pipeline.yaml"), metavar="FILE")

    submit = sub.add_parser("submit", help="compile and start a run on a Kubeflow Pipelines API (kfp.Client)")
    _add_pipeline_config(submit)
    submit.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint, e.g. http://localhost:8080")
    submit.add_argument("--experiment", help="KFP experiment (default: tracking.experiment)")
    submit.add_argument("--run-name", help="run name (default: kubealign-<timestamp>)")
    submit.add_argument("--namespace", help="profile namespace on multi-user Kubeflow")
    submit.add_argument("--no-cache", action="store_true", help="run every task even if KFP has a cached result")
    submit.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")
    submit.add_argument("--no-parent-run", action="store_true",
                        help="do not create a parent MLflow run for the pipeline run")  # fmt: skip

    upload = sub.add_parser("upload", help="compile and upload the pipeline to KFP (new pipeline or new version)")
    _add_pipeline_config(upload)
    upload.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint")
    upload.add_argument(
        "--pipeline-name", default="kubealign-rlhf", help="pipeline name in KFP (default: kubealign-rlhf)"
    )
    upload.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")

    rerun = sub.add_parser("rerun", help="rerun one stage (and optionally its downstream) on an earlier run's outputs")
    rerun.add_argument(
        "stage",
        choices=[*SHARED, *ROUTES, "evaluate", "promote", "compare"],
        help="a stage; in a run comparing several routes, a route (its training, evaluation, then the comparison "
        "and the promotions) or compare",
    )
    rerun.add_argument("--from", dest="run", required=True, type=Path, metavar="RUN_DIR",
                       help="--output of an earlier `kubealign run`")  # fmt: skip
    rerun.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one field of that run's config (repeatable)")  # fmt: skip
    rerun.add_argument("--downstream", action="store_true", help="also rerun every stage that depends on it")
    rerun.add_argument("--output", type=Path, metavar="DIR", help="default: RUN_DIR-rerun-STAGE-<timestamp>")

    summary = sub.add_parser("summary", help="one-screen summary of a run directory (as make demo writes)")
    summary.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/demo"), help="default: runs/demo")

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny (2-layer, width-128) model with a locally trained tokenizer",
        description="Build tiny-opt or tiny-llama from config (no download) into an HF model dir.",
    )
    tiny.add_argument("--arch", required=True, choices=["opt", "llama"], help="architecture")
    tiny.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights and tokenizer (default 0)")

    config = sub.add_parser("config", help="inspect configurations")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (defaults, file, --set)")
    _add_config_options(show)
    config_sub.add_parser("presets", help="list the shipped presets")
    return parser


def _print_split_summary(result: dict[str, Any]) -> None:
    import json

    manifest = json.loads((Path(result["output"]) / "manifest.json").read_text(encoding="utf-8"))
    status = "cache hit (reused)" if result["cache_hit"] else "computed"
    print(f"data-split: {status} -> {result['output']}  ({result['wall_time_s']:.1f} s)")
    print(f"  rows: {manifest['rows']['read']} read, {manifest['rows']['kept']} kept")
    print(f"  {'phase':<16}{'train rows':>11}{'eval rows':>11}{'prompts':>9}")
    for phase, entry in manifest["phases"].items():
        splits = entry["splits"]
        prompts = splits["train"]["prompts"] + splits["eval"]["prompts"]
        print(f"  {phase:<16}{splits['train']['rows']:>11}{splits['eval']['rows']:>11}{prompts:>9}")
    for reason, entry in sorted(manifest["dropped"].items()):
        print(f"  dropped {entry['count']:>5} {reason} (first: {', '.join(entry['examples'][:2])})")
    if manifest["invalid"]["count"]:
        print(f"  skipped {manifest['invalid']['count']:>5} malformed rows (on_error: skip)")
    if result.get("tracking_uri"):
        print(f"  MLflow run {result['run_id']} in {result['tracking_uri']}")
        if result["tracking_uri"].startswith("sqlite:"):
            print(f"  open the UI: mlflow ui --backend-store-uri {result['tracking_uri']}")


def _data_split(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import data_split

    overrides = list(args.overrides)
    if args.sources:  # first, so that a --set on data.sources still wins
        import json

        overrides.insert(0, "data.sources=" + json.dumps([{"path": p} for p in args.sources]))
    config = load_config(args.config, overrides)
    _print_split_summary(data_split.run(config, args.output, force=args.force))


def _add_functions_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reward-functions",
        type=Path,
        metavar="JSON",
        help="the reward functions with their source, as a pipeline task hands them on (default: rewards.functions)",
    )


def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint (--checkpoints)")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        metavar="CKPT_DIR",
        help="where the checkpoints go (default: DIR.checkpoints beside --output; a pipeline task uses the PVC)",
    )


def _functions(args: argparse.Namespace) -> list | None:
    """The specs of --reward-functions, or None (resolved from the config's rewards.functions)."""
    if args.reward_functions is None:
        return None
    from kubealign.rewards import sources

    try:
        return sources.from_json(args.reward_functions.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--reward-functions {args.reward_functions}: {exc.strerror}") from None


def _train(args: argparse.Namespace) -> None:
    from kubealign.config import load_config

    if args.command == "sft":
        from kubealign.stages import sft as stage
    elif args.command == "dpo":
        from kubealign.stages import dpo as stage
    else:
        from kubealign.stages import reward as stage
    config = load_config(args.config, args.overrides)
    result = stage.run(config, args.data, args.model, args.output, args.resume, args.checkpoints)
    if int(os.environ.get("RANK", "0")) == 0:
        metrics = result["metrics"]
        shown = {k: v for k, v in metrics.items() if k.startswith(("before_", "after_"))}
        print(f"{args.command}: {result['output']}  ({metrics['steps']} steps, {metrics['tokens_per_s']:.0f} tokens/s)")
        print("  " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))


def _ppo(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import ppo

    config = load_config(args.config, args.overrides)
    result = ppo.run(config, args.prompts, args.actor, args.critic, args.reward, args.output, resume=args.resume,
                     functions=_functions(args), checkpoint_location=args.checkpoints)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        m = result["metrics"]
        print(f"ppo: {result['output']}  (rollout path: {result['rollout_path']})")
        print(f"  eval reward {m['reward_before']:.3f} -> {m['reward_after']:.3f}, KL to reference {m['kl_after']:.3f}")
        for key in (k for k in m if k.startswith("fn/") and k.endswith("/before")):
            name = key.removesuffix("/before")
            print(f"  {name} {m[key]:.3f} -> {m.get(name + '/after', float('nan')):.3f}")
        print(f"  time: generation {m['generation_time_s']:.1f} s, training {m['training_time_s']:.1f} s")


def _evaluate(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import evaluate
    from kubealign.summary import evaluate_lines

    config = load_config(args.config, args.overrides)
    result = evaluate.run(config, args.prompts, args.baseline, args.candidate, args.reward, args.output,
                          functions=_functions(args))  # fmt: skip
    m = result["metrics"]
    print(f"evaluate: {result['output']}  ({m['prompts']} prompts)")
    for line in evaluate_lines(m):
        print(f"  {line}")
    print(f"  length drift {m['length_drift']:.2f}, samples: {Path(result['output']) / 'samples.html'}")


def _promote(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import promote

    result = promote.run(load_config(args.config, args.overrides), args.evaluation, args.model_dir, args.output)
    print(f"promote: {result['registered_model']} version {result['version']}; aliases {result['aliases']}")
    for line in result["gate"]:
        print(f"  {line}")


def _rollback(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import promote

    state = promote.rollback(load_config(args.config, args.overrides))
    print(f"rollback: champion is version {state['champion']} again (was {state['rolled_back_from']})")


def _run(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines import local
    from kubealign.summary import summarize

    config = load_config(args.config, args.overrides)
    try:
        index = local.run(config, args.output, caching=args.cache, verbose=args.verbose, runner=args.runner)
    except local.PipelineFailed as exc:
        raise UserError(str(exc)) from None
    print()
    print("\n".join(summarize(args.output)))
    mlflow = index["mlflow"]
    print(f"\npipeline run: {index['wall_time_s']:.0f} s; artifacts indexed in {args.output.resolve() / 'run.json'}")
    print(f"task logs: {args.output.resolve() / local.LOGS_DIR}/<task>.log")
    print(f"MLflow: parent run {mlflow['parent_run_id']} in {mlflow['tracking_uri']}")
    if mlflow["tracking_uri"].startswith("sqlite:"):
        print(f"  open the UI: mlflow ui --backend-store-uri {mlflow['tracking_uri']}")


def _images(args: argparse.Namespace) -> None:
    from kubealign.containers import build, daemon

    if args.images_command == "daemon":
        if args.action == "start":
            print(f"export DOCKER_HOST={daemon.start()}")
        elif args.action == "stop":
            print("stopped" if daemon.stop() else "not running")
        else:
            pid, sock = daemon.pid(), daemon.state_dir() / "docker.sock"
            print(f"running (pid {pid}), DOCKER_HOST=unix://{sock}" if pid else "not running")
        return
    client = daemon.client()
    try:
        built = build.build(client, args.image, args.base, say=print, cuda_arch_list=args.cuda_arch_list)
    finally:
        client.close()
    if built.check:
        torch, ds = built.check["torch"], built.check["deepspeed"]
        print(
            f"checked in the image: torch {torch['version']} (CUDA {torch['cuda']}), "
            f"deepspeed {ds['version']} with {', '.join(sorted(ds['loaded']))} prebuilt and loading, "
            f"{built.check['distributions']} distributions at their pinned versions, uid {built.check['uid']}"
        )
    print(
        f"built {built.image}: {built.size_bytes / 1e9:.2f} GB, Python {built.python}, base {built.base}, "
        f"{built.seconds:.0f} s"
    )


def _compile(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import compile_pipeline

    path = compile_pipeline(load_config(args.config, args.overrides), args.output)
    print(f"compiled pipeline -> {path}")


def _submit(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import submit

    result = submit(
        load_config(args.config, args.overrides), args.host, args.experiment, args.run_name, args.namespace,
        enable_caching=not args.no_cache, token=args.token, parent_run=not args.no_parent_run,
    )  # fmt: skip
    print(f"submitted run {result['run_name']} ({result['run_id']}): {result['url']}")
    if result["mlflow_parent_run_id"]:
        print(f"MLflow parent run: {result['mlflow_parent_run_id']}")


def _upload(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import upload

    result = upload(load_config(args.config, args.overrides), args.host, args.pipeline_name, token=args.token)
    print(f"uploaded {args.pipeline_name} version {result['version']} (pipeline id {result['pipeline_id']})")


def _rerun(args: argparse.Namespace) -> None:
    from kubealign.pipelines.rerun import rerun
    from kubealign.summary import summarize

    index = rerun(args.stage, args.run, args.overrides, downstream=args.downstream, output=args.output)
    out = Path(index["stages"][index["rerun"][0]]["dir"]).parent
    print(f"reran {', '.join(index['rerun'])}; reused {', '.join(index['reused']) or 'nothing'} from {args.run}")
    print("\n".join(summarize(out)))


def _summary(args: argparse.Namespace) -> None:
    from kubealign.summary import summarize

    lines = summarize(args.run_dir)
    if len(lines) == 1:
        raise UserError(f"{args.run_dir}: no stage results (expected data-split/, sft/, ... with result.json)")
    print("\n".join(lines))


def _tiny_model(args: argparse.Namespace) -> None:
    from kubealign.models import tiny
    from kubealign.outputs import check_output_path, write_result

    check_output_path(args.output, "tiny-model")
    path = tiny.build(args.arch, args.output, args.seed)
    write_result(path, "tiny-model", {}, {"model": "."}, arch=args.arch, seed=args.seed)
    print(f"tiny-{args.arch} (seed {args.seed}) -> {path}")


def _config(args: argparse.Namespace) -> None:
    from kubealign.config import config_to_yaml, load_config, preset_names

    if args.config_command == "presets":
        print("\n".join(preset_names()))
        return
    sys.stdout.write(config_to_yaml(load_config(args.config, args.overrides)))


COMMANDS = {
    "data-split": _data_split,
    "sft": _train,
    "reward": _train,
    "dpo": _train,
    "ppo": _ppo,
    "evaluate": _evaluate,
    "promote": _promote,
    "rollback": _rollback,
    "run": _run,
    "images": _images,
    "compile": _compile,
    "submit": _submit,
    "upload": _upload,
    "rerun": _rerun,
    "summary": _summary,
    "tiny-model": _tiny_model,
    "config": _config,
}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config_option", None) is not None:
        if args.config is not None:
            parser.error(f"the config is given twice ({args.config} and --config {args.config_option}): give one")
        args.config = args.config_option
    try:
        COMMANDS[args.command](args)
    except UserError as exc:
        # One write, so the lines of several ranks sharing one stderr pipe never run into each other.
        sys.stderr.write(f"kubealign: error: {exc}\n")
        sys.stderr.flush()
        return 2
    except Stopped as exc:  # a checkpoint was saved first: not an error, a stop (the MLflow run is KILLED)
        sys.stderr.write(f"kubealign: {exc}\n")
        sys.stderr.flush()
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("kubealign: interrupted", file=sys.stderr)
        return 130
    return 0


def console() -> None:
    """The `kubealign` console script: main(), then the process group torn down before exit (see
    distributed.shutdown). Not in main(): in-process callers (tests, kfp.local tasks) call main() again
    in the same process, and DeepSpeed keeps its groups cached across calls."""
    code = main()
    if "torch.distributed" in sys.modules:  # only commands that trained or evaluated imported it
        import logging

        from kubealign.training import distributed

        distributed.shutdown(ok=code == 0)
        # Even with the group destroyed, a C++ thread (gloo, DeepSpeed's shm comm op) torn down by the
        # interpreter's exit can still abort a rank ("terminate called without an active exception", seen
        # once in 4 two-rank runs). Everything the command writes is closed or flushed by now: leave
        # without the interpreter's teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
