"""The `kubealign round` commands: the feedback loop turned by a command, or by a schedule (docs/feedback.md
"Rounds"). next: the next round from the last one's output (its config, round + 1, the previous round's MLflow
run), run here through kfp.local as `kubealign run` runs. push: the pairs the last round's canary served, to people
(feedback push --from-judge on the round's judge output, with its config). schedule: the pipeline as a KFP recurring
run on a cluster (kfp.Client), one round per tick."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_set_option


def add_parser(sub: Any) -> None:
    rounds = sub.add_parser(
        "round",
        help="rounds of the feedback loop: serve -> people -> retrain (docs/feedback.md)",
        description="next: start the next round from a round's output; push: its served pairs to Label Studio; "
        "schedule: one round per cron tick as a KFP recurring run.",
    )
    actions = rounds.add_subparsers(dest="round_command", metavar="ACTION", required=True)
    nxt = actions.add_parser("next", help="run the next round here (kfp.local) from the last round's output")
    nxt.add_argument("--from", dest="run", required=True, type=Path, metavar="RUN_DIR", help="the last round's output")
    nxt.add_argument("--output", required=True, type=Path, metavar="DIR", help="the new round's output")
    nxt.add_argument("--cache", action="store_true", help="reuse unchanged tasks (as kubealign run --cache)")
    nxt.add_argument("-v", "--verbose", action="store_true", help="stream every task's output")
    add_set_option(nxt)
    nxt.set_defaults(func=next_command)
    push = actions.add_parser("push", help="the pairs a round's canary served -> its Label Studio project")
    push.add_argument("--from", dest="run", required=True, type=Path, metavar="RUN_DIR", help="the round's output")
    push.add_argument("--url", metavar="URL", help="Label Studio (default: $LABEL_STUDIO_URL, else feedback.url)")
    push.add_argument(
        "--judge",
        type=Path,
        metavar="DIR",
        help="a `kubealign judge --output` (the round's canary served and judged outside the DAG, as on a laptop); "
        "default: the round's judge task",
    )
    push.set_defaults(func=push_command)
    when = actions.add_parser("schedule", help="the pipeline as a KFP recurring run: a round per cron tick")
    when.add_argument("config", nargs="?", metavar="CONFIG", help="YAML file or preset (default: tiny-cpu)")
    add_set_option(when)
    when.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint")
    when.add_argument("--cron", required=True, help="KFP's cron (six fields, seconds first): '0 0 3 * * 1'")
    when.add_argument("--name", default="kubealign-rounds", help="the recurring run's name")
    when.add_argument("--experiment", help="KFP experiment (default: tracking.experiment)")
    when.add_argument("--namespace", help="profile namespace on multi-user Kubeflow")
    when.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")
    when.set_defaults(func=schedule_command)
    rounds.set_defaults(func=command)


def command(args: argparse.Namespace) -> None:
    {"next": next_command, "push": push_command, "schedule": schedule_command}[args.round_command](args)


def next_command(args: argparse.Namespace) -> None:
    from kubealign.cli.pipeline import run_command
    from kubealign.feedback import rounds
    from kubealign.outputs import read_json
    from kubealign.pipelines.local import INDEX_FILE

    index = read_json(args.run, INDEX_FILE, "expected the --output of `kubealign run` (a round)")
    config = rounds.next_config(index, args.run, args.overrides)
    print(f"round {config.feedback.round}: after round {config.feedback.round - 1} ({config.feedback.previous_run})")
    run_command(argparse.Namespace(**vars(args), config_object=config, runner="subprocess"))


def push_command(args: argparse.Namespace) -> None:
    from kubealign.cli.feedback import push_served
    from kubealign.feedback import rounds
    from kubealign.feedback.client import URL_ENV, connect
    from kubealign.outputs import read_json
    from kubealign.pipelines.local import INDEX_FILE

    index = read_json(args.run, INDEX_FILE, "expected the --output of `kubealign run` (a round)")
    config = rounds.last_round(index, args.run)
    client = connect(args.url or os.environ.get(URL_ENV) or config.feedback.url, config.feedback)  # as the task
    judged = args.judge or rounds.served_dir(index, args.run)
    push_served(client, config.feedback.project, judged, config, config.promote.registered_model)


def schedule_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.pipelines.remote import schedule

    config = load_config(args.config, args.overrides)
    made = schedule(config, args.host, args.cron, args.name, args.experiment, args.namespace, args.token)
    print(f"scheduled {args.name} ({made['recurring_run_id']}, cron {args.cron!r}): {made['url']}")
