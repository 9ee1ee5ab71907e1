"""The data and training commands of `kubealign`: data-split, then the training stages sft, reward, dpo and ppo,
each its parser beside the handler that runs it (kubealign.stages does the work)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_config_options, add_functions_option, reward_functions
from kubealign.ranks import is_main

VERBOSE_ENV = "KUBEALIGN_VERBOSE"
# DeepSpeed's warning that it has no injected kernels for the model (OPT under transformers >= 4.51, every model on
# a CPU): the rollout then uses the model's own generate(), as the preflight records (the run's rollout path).
QUIET_DEEPSPEED = ("inference acceleration is unavailable",)


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=f"show the libraries' messages too (MLflow's INFO lines, DeepSpeed's notices); also {VERBOSE_ENV}=1",
    )


def _deepspeed_worth_showing(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING and not any(text in record.getMessage() for text in QUIET_DEEPSPEED)


def quiet_libraries(verbose: bool) -> None:
    """A stage command's screen: its own lines and the warnings that matter. Unless `verbose` or
    KUBEALIGN_VERBOSE=1: MLflow's loggers at WARNING (here and in every process started from here), DeepSpeed's
    INFO lines and its Hybrid Engine notice (QUIET_DEEPSPEED) dropped."""
    if verbose:  # told on: so is every process started from here, and training.ds_prints
        os.environ[VERBOSE_ENV] = "1"
    if verbose or os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0"):
        return
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read by mlflow when imported
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # in case it is imported already
    logging.getLogger("DeepSpeed").addFilter(_deepspeed_worth_showing)  # kept when deepspeed sets its level


def add_parser(sub: Any) -> None:
    split = sub.add_parser(
        "data-split",
        help="stage 0: normalize, validate, deduplicate and split data into the three phases",
        description="Read data.sources, normalize rows to {prompt, chosen, rejected}, drop bad rows, split "
        "unique prompts into phase1_sft / phase2_reward / phase3_prompts and write a manifest.",
    )
    add_config_options(split)
    add_verbose_option(split)
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
    split.set_defaults(func=data_split_command)
    _add_trainers(sub)
    _add_ppo(sub)


def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint (--checkpoints)")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        metavar="CKPT_DIR",
        help="where the checkpoints go (default: DIR.checkpoints beside --output; a pipeline task uses the PVC)",
    )


def _add_trainers(sub: Any) -> None:
    """sft, reward and dpo: one model trained on one phase of the split."""
    for stage, phase, what in (
        ("sft", "phase1_sft", "stage 1: supervised fine-tuning on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("reward", "phase2_reward", "stage 2: reward model (Bradley-Terry) on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("dpo", "phase2_reward", "the dpo route: DPO from the SFT model on the preference pairs (ZeRO 0-3, LoRA)"),
    ):
        train = sub.add_parser(stage, help=what, description=what)
        add_config_options(train)
        add_verbose_option(train)
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
        train.set_defaults(func=train_command)


def _add_ppo(sub: Any) -> None:
    ppo = sub.add_parser(
        "ppo",
        help="stage 3: PPO with the DeepSpeed Hybrid Engine (actor, reference, critic, reward)",
        description="PPO (GRPO, RLOO: ppo.algorithm) on phase-3 prompts: actor and reference from the SFT dir, the "
        "score from the reward model (--reward, else --critic) and / or the reward functions of rewards.functions. "
        "The critic (ppo only): --critic, else the reward model, else the SFT model with a new value head.",
    )
    add_config_options(ppo)
    add_verbose_option(ppo)
    ppo.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output (or phase3)")
    ppo.add_argument("--actor", required=True, type=Path, metavar="SFT_DIR", help="SFT model dir (actor + reference)")
    ppo.add_argument("--critic", type=Path, metavar="RM_DIR", help="critic start (ppo; default: the reward model)")
    ppo.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model (default: --critic; none: rewards.model_weight 0)"
    )
    ppo.add_argument("--output", required=True, type=Path, metavar="DIR", help="output actor directory")
    add_functions_option(ppo)
    _add_checkpoint_options(ppo)
    ppo.set_defaults(func=ppo_command)


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


def data_split_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import data_split

    quiet_libraries(args.verbose)
    overrides = list(args.overrides)
    if args.sources:  # first, so that a --set on data.sources still wins
        import json

        overrides.insert(0, "data.sources=" + json.dumps([{"path": p} for p in args.sources]))
    config = load_config(args.config, overrides)
    _print_split_summary(data_split.run(config, args.output, force=args.force))


def train_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config

    quiet_libraries(args.verbose)
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


def ppo_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import ppo

    quiet_libraries(args.verbose)
    config = load_config(args.config, args.overrides)
    result = ppo.run(
        config,
        args.prompts,
        args.actor,
        args.critic,
        args.reward,
        args.output,
        resume=args.resume,
        functions=reward_functions(args),
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
