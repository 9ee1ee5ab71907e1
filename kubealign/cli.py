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

from kubealign.cli_args import build_parser
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
    from kubealign.rewards import definitions

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
    from kubealign.config import load_config
    from kubealign.stages import evaluate
    from kubealign.summary import evaluate_lines

    config = load_config(args.config, args.overrides)
    result = evaluate.run(
        config, args.prompts, args.baseline, args.candidate, args.reward, args.output, functions=_functions(args)
    )
    m = result["metrics"]
    print(f"evaluate: {result['output']}  ({m['prompts']} prompts)")
    for line in evaluate_lines(m):
        print(f"  {line}")
    print(f"  length drift {m['length_drift']:.2f}, samples: {Path(result['output']) / 'samples.html'}")


def _judge(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.serving import act
    from kubealign.stages import judge

    if args.namespace and not args.act:
        raise UserError("--namespace: only with --act (the served model changes only when the verdict is acted on)")
    config = load_config(args.config, args.overrides)
    uri, version = act.judged_version(config) if args.act else (None, "?")
    inputs = (args.prompts, args.tokenizer, args.reward, args.champion, args.canary, args.output, args.served_name)
    result = judge.run(config, *inputs, version)
    print(f"  checks and figures: {Path(result['output']) / 'judge.md'}")
    if not args.act:
        return

    after = act.in_registry(config, uri, result["promoted"], version)
    print(f"  registry: {', '.join(f'{a} = {v}' for a, v in after.items())}")
    if args.namespace:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
        print(f"  serving: InferenceService {act.in_serving(config, uri, args.namespace, custom)}, Ready")


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

    config = load_config(args.config, args.overrides)
    state = promote.rollback(config)
    print(f"rollback: champion is version {state['champion']} again (was {state['rolled_back_from']})")
    if args.namespace:  # the served model follows the registry: the champion's InferenceService, no canary
        from kubealign.cluster.trainjob import connect
        from kubealign.serving import act
        from kubealign.tracking import resolve_uri

        custom, _ = connect()
        action = act.in_serving(config, resolve_uri(config), args.namespace, custom)
        print(f"rollback: InferenceService {args.namespace}: {action}, Ready")


def _registry(args: argparse.Namespace) -> None:
    from kubealign.cluster import registry_auth

    if args.registry_command == "auth-config":
        registry_auth.write_config(args.output)
        print(f"registry: basic-auth config written to {args.output}")
        return
    wanted = registry_auth.identities()
    if not wanted:
        raise UserError("no identity to create: set KUBEALIGN_PIPELINE_USERNAME / _PASSWORD (and the reader's)")
    registry_auth.wait_until_up(args.tracking_uri, args.wait)
    for line in registry_auth.ensure(args.tracking_uri, wanted):
        print(f"registry: {line}")


def _serve(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.serving import manifest_for, write_manifest
    from kubealign.tracking import check_uri, resolve_uri

    config = load_config(args.config, args.overrides)
    check_uri(args.tracking_uri, "--tracking-uri")
    uri = args.tracking_uri or resolve_uri(config)
    if not uri:
        raise UserError("--tracking-uri: no registry given (nor MLFLOW_TRACKING_URI, nor tracking.uri)")
    cfg = config.serve.model_copy(update={"alias": args.alias} if args.alias else {})
    name = args.model or config.promote.registered_model
    percent = _canary_percent(args, cfg, config.canary.percent)
    if args.manifest is None:
        from kubealign.serving import local

        local.serve(cfg, uri, name, args.port)
        return
    namespace = args.namespace or cfg.namespace or "default"
    canary = (args.canary, percent) if args.canary else None
    body = manifest_for(cfg, uri, name, namespace, config.kubernetes.accelerator_type, canary)
    write_manifest(body, args.manifest)
    meta = body["metadata"]
    print(
        f"serve: {name}@{cfg.alias} = version {meta['annotations']['kubealign.io/model-version']}; "
        f"InferenceService {namespace}/{meta['name']} written to {args.manifest}"
    )
    print(f"  storageUri {body['spec']['predictor']['model']['storageUri']}")
    if args.canary:
        version = meta["annotations"]["kubealign.io/canary-model-version"]
        print(f"  canary {name}@{args.canary} = version {version}, {percent} % of the traffic")
    print(f"  apply: kubectl apply -f {args.manifest}")


def _canary_percent(args: argparse.Namespace, cfg: Any, default: int) -> int:
    """--canary-percent (or canary.percent), checked; --canary needs --manifest and another alias."""
    if (args.canary or args.canary_percent is not None) and args.manifest is None:
        raise UserError("--canary / --canary-percent: only with --manifest (here, one alias is served)")
    if args.canary_percent is not None and not args.canary:
        raise UserError("--canary-percent: give --canary ALIAS, the alias that gets that share")
    if args.canary is not None and args.canary == cfg.alias:
        raise UserError(f"--canary {args.canary}: that is the alias served (--alias); name another, e.g. challenger")
    percent = default if args.canary_percent is None else args.canary_percent
    if not 1 <= percent <= 99:
        raise UserError(f"--canary-percent {percent}: a share from 1 to 99 (100 is promotion, 0 no canary)")
    return percent


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
    "judge": _judge,
    "run": _run,
    "images": _images,
    "compile": _compile,
    "submit": _submit,
    "upload": _upload,
    "rerun": _rerun,
    "summary": _summary,
    "tiny-model": _tiny_model,
    "registry": _registry,
    "serve": _serve,
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
