"""The inspection and helper commands of `kubealign`, each its parser beside its handler: summary (a run on one
screen, rendered by kubealign.cli.summary), tiny-model (a tiny model built here, no download) and config (the
resolved config, the shipped presets)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_config_options
from kubealign.errors import UserError


def add_parser(sub: Any) -> None:
    summary = sub.add_parser("summary", help="one-screen summary of a run directory (as make demo writes)")
    summary.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/demo"), help="default: runs/demo")
    summary.set_defaults(func=summary_command)

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny (2-layer, width-128) model with a locally trained tokenizer",
        description="Build tiny-opt or tiny-llama from config (no download) into an HF model dir.",
    )
    tiny.add_argument("--arch", required=True, choices=["opt", "llama"], help="architecture")
    tiny.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights and tokenizer (default 0)")
    tiny.set_defaults(func=tiny_model_command)

    config = sub.add_parser("config", help="inspect configurations")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (defaults, file, --set)")
    add_config_options(show)
    config_sub.add_parser("presets", help="list the shipped presets")
    config.set_defaults(func=config_command)


def summary_command(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import summarize

    lines = summarize(args.run_dir)
    if len(lines) == 1:
        raise UserError(f"{args.run_dir}: no stage results (expected data-split/, sft/, ... with result.json)")
    print("\n".join(lines))


def tiny_model_command(args: argparse.Namespace) -> None:
    from kubealign.models import tiny
    from kubealign.outputs import check_output_path, write_result

    check_output_path(args.output, "tiny-model")
    path = tiny.build(args.arch, args.output, args.seed)
    write_result(path, "tiny-model", {}, {"model": "."}, arch=args.arch, seed=args.seed)
    print(f"tiny-{args.arch} (seed {args.seed}) -> {path}")


def config_command(args: argparse.Namespace) -> None:
    from kubealign.config import config_to_yaml, load_config, preset_names

    if args.config_command == "presets":
        print("\n".join(preset_names()))
        return
    sys.stdout.write(config_to_yaml(load_config(args.config, args.overrides)))
