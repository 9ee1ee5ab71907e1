"""The options several command families share: the config (--config, --set) and the reward functions as a
pipeline task hands them on (--reward-functions, with the reader of its file)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kubealign.errors import UserError


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file or preset name (default: the tiny-cpu preset, configs/tiny-cpu.yaml)",
    )
    add_set_option(parser)


def add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable); VALUE is YAML, e.g. --set data.split_ratios=[1,1,1]",
    )


def add_functions_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reward-functions",
        type=Path,
        metavar="JSON",
        help="the reward functions with their source, as a pipeline task hands them on (default: rewards.functions)",
    )


def reward_functions(args: argparse.Namespace) -> list | None:
    """The specs of --reward-functions, or None (resolved from the config's rewards.functions)."""
    if args.reward_functions is None:
        return None
    from kubealign.usercode import definitions

    try:
        return definitions.from_json(args.reward_functions.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--reward-functions {args.reward_functions}: {exc.strerror}") from None
