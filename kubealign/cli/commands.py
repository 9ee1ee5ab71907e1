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

from kubealign.cli import feedback
from kubealign.cli.parser import build_parser
from kubealign.cli.serving import judge_command, rollback_command, serve_command
from kubealign.errors import Stopped, UserError
from kubealign.ranks import is_main


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


def _functions(args: argparse.Namespace) -> list | None:
    """The specs of --reward-functions, or None (resolved from the config's rewards.functions)."""
    if args.reward_functions is None:
        return None
    from kubealign.usercode import definitions

    try:
        return definitions.from_json(args.reward_functions.read_text(encoding="utf-8"))
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
    if is_main():
        metrics = result["metrics"]
        shown = {k: v for k, v in metrics.items() if k.startswith(("before_", "after_"))}
        print(f"{args.command}: {result['output']}  ({metrics['steps']} steps, {metrics['tokens_per_s']:.0f} tokens/s)")
        print("  " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))


def _ppo(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import ppo

    config = load_config(args.config, args.overrides)
    result = ppo.run(
        config,
        args.prompts,
        args.actor,
        args.critic,
        args.reward,
        args.output,
        resume=args.resume,
        functions=_functions(args),
        checkpoint_location=args.checkpoints,
    )
    if is_main():
        m = result["metrics"]
        print(f"ppo: {result['output']}  (rollout path: {result['rollout_path']})")
        print(f"  eval reward {m['reward_before']:.3f} -> {m['reward_after']:.3f}, KL to reference {m['kl_after']:.3f}")
        for key in (k for k in m if k.startswith("fn/") and k.endswith("/before")):
            name = key.removesuffix("/before")
            print(f"  {name} {m[key]:.3f} -> {m.get(name + '/after', float('nan')):.3f}")
        print(f"  time: generation {m['generation_time_s']:.1f} s, training {m['training_time_s']:.1f} s")


def _evaluate(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import evaluate_lines
    from kubealign.config import load_config
    from kubealign.stages import evaluate

    config = load_config(args.config, args.overrides)
    result = evaluate.run(
        config, args.prompts, args.baseline, args.candidate, args.reward, args.output, functions=_functions(args)
    )
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
    if result.get("refusal"):
        print(result["refusal"])


def _registry(args: argparse.Namespace) -> None:
    from kubealign.cluster import registry_auth

    if args.registry_command == "auth-config":
        registry_auth.write_config(args.output)
        print(f"registry: basic-auth config written to {args.output}")
        return
    wanted = registry_auth.identities()
    if not wanted:
        raise UserError(
            "no identity to create: set KUBEALIGN_PIPELINE_USERNAME / _PASSWORD (and the tracker's, the reader's)"
        )
    registry_auth.wait_until_up(args.tracking_uri, args.wait)
    for line in registry_auth.ensure(args.tracking_uri, wanted):
        print(f"registry: {line}")
    for line in registry_auth.claim_models(args.tracking_uri, args.registered_model, wanted):
        print(f"registry: {line}")
    for line in registry_auth.claim_experiments(args.tracking_uri, args.experiment, wanted):
        print(f"registry: {line}")


def _run(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize
    from kubealign.config import load_config
    from kubealign.pipelines import local

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


def _upload(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import upload

    result = upload(load_config(args.config, args.overrides), args.host, args.pipeline_name, token=args.token)
    print(f"uploaded {args.pipeline_name} version {result['version']} (pipeline id {result['pipeline_id']})")


def _rerun(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize
    from kubealign.pipelines.rerun import rerun

    index = rerun(args.stage, args.run, args.overrides, downstream=args.downstream, output=args.output)
    out = Path(index["stages"][index["rerun"][0]]["dir"]).parent
    print(f"reran {', '.join(index['rerun'])}; reused {', '.join(index['reused']) or 'nothing'} from {args.run}")
    print("\n".join(summarize(out)))


def _summary(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize

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
    "rollback": rollback_command,
    "judge": judge_command,
    "run": _run,
    "images": _images,
    "compile": _compile,
    "submit": _submit,
    "upload": _upload,
    "rerun": _rerun,
    "summary": _summary,
    "tiny-model": _tiny_model,
    "registry": _registry,
    "serve": serve_command,
    "config": _config,
    "feedback": feedback.command,
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
