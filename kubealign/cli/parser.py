"""The `kubealign` command: the top-level parser assembled from the command families, and the dispatch.

Each family is one module holding its commands' parsers (add_parser) beside their handlers; every command's
parser names its handler (set_defaults(func=...)), which main calls. Every stage command takes --config (a
YAML file or a preset name; default: the tiny-cpu preset), repeated --set section.key=value overrides, its
input paths and --output DIR, and writes DIR/result.json. Bad input exits with code 2 and one line naming the
file, line or field.
"""

from __future__ import annotations

import argparse
import os
import sys

from kubealign import __version__
from kubealign.cli import feedback, images, judging, pipeline, registry, rounds, serving, tools, training
from kubealign.errors import Stopped, UserError

# In the order `kubealign --help` lists their commands.
FAMILIES = (training, judging, pipeline, images, tools, registry, serving, feedback, rounds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubealign",
        description="RLHF (SFT, reward model, PPO with DeepSpeed's Hybrid Engine) as a Kubeflow pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"kubealign {__version__}")
    # The deepspeed launcher puts --local_rank=N right after the script name (torchrun sets LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for family in FAMILIES:
        family.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    # The pipeline family's config comes as a positional or as --config (kubealign.cli.pipeline): one of them.
    if getattr(args, "config_option", None) is not None:
        if args.config is not None:
            parser.error(f"the config is given twice ({args.config} and --config {args.config_option}): give one")
        args.config = args.config_option
    try:
        args.func(args)
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
