"""The `kubealign feedback` commands, their parser beside their handlers. push: two registry aliases' answers to
held-out prompts, as pairwise Label Studio tasks (kubealign.feedback.push). pull: people's choices in a Label
Studio project -> a preference file data-split reads: the rows (prompt, chosen, rejected) written atomically,
deduplicated; the counts, the human win-rate of the challenger with its 95 % interval and the people's
agreement printed and logged to MLflow as a `feedback` run whose dataset input is the file (its sha256, the
project, the versions compared, the annotators), so the next reward model's lineage can lead back to it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign.errors import UserError


def add_parser(sub: Any) -> None:
    feedback = sub.add_parser(
        "feedback",
        help="people's choices between two models, through Label Studio (docs/feedback.md)",
        description="pull: the completed pairwise annotations of a Label Studio project as preference rows "
        "(prompt, chosen, rejected) for data.sources. Connection: --url or LABEL_STUDIO_URL, the token in "
        "LABEL_STUDIO_API_KEY (a legacy API token).",
    )
    actions = feedback.add_subparsers(dest="feedback_command", metavar="ACTION", required=True)
    push = actions.add_parser("push", help="two aliases' answers to held-out prompts -> pairwise tasks")
    push.add_argument("--project", required=True, metavar="TITLE", help="the Label Studio project (created if missing)")
    push.add_argument(
        "--prompts",
        type=Path,
        metavar="DIR|FILE",
        help="a data-split output (its held-out phase-3 prompts) or a .jsonl file of {prompt} rows",
    )
    push.add_argument(
        "--from-judge",
        type=Path,
        metavar="DIR",
        help="instead of --prompts: the pairs the champion and the canary served to a judge (its output), nothing "
        "regenerated; up to feedback.budget of them, where the judges disagree most, the rest at random",
    )
    push.add_argument("-n", "--count", type=int, default=8, metavar="N", help="prompts to push (default 8)")
    push.add_argument("--first", default="champion", metavar="ALIAS", help="one side (default champion)")
    push.add_argument("--second", default="challenger", metavar="ALIAS", help="the other side (default challenger)")
    push.add_argument("--model", metavar="NAME", help="registered model (default: promote.registered_model)")
    push.add_argument("--tracking-uri", metavar="URL", help="the registry (default: MLFLOW_TRACKING_URI, tracking.uri)")
    push.add_argument(
        "--url", metavar="URL", help="Label Studio (default: $LABEL_STUDIO_URL, else http://localhost:8080)"
    )
    push.add_argument("--config", dest="config", metavar="CONFIG", help="config (evaluate's sampling settings)")
    pull = actions.add_parser("pull", help="annotations -> a preference JSONL file, logged to MLflow")
    pull.add_argument("--project", required=True, metavar="TITLE", help="the Label Studio project's title")
    pull.add_argument("--output", required=True, type=Path, metavar="FILE", help="the .jsonl file to write")
    pull.add_argument(
        "--url", metavar="URL", help="Label Studio (default: $LABEL_STUDIO_URL, else http://localhost:8080)"
    )
    pull.add_argument(
        "--challenger",
        default="challenger",
        metavar="ALIAS",
        help="whose human win-rate is reported (default challenger)",
    )
    pull.add_argument("--config", dest="config", metavar="CONFIG", help="config whose tracking section is used")
    feedback.set_defaults(func=command)


def command(args: argparse.Namespace) -> None:
    if args.feedback_command == "push":
        push_command(args)
    else:
        pull_command(args)


def connect(args: argparse.Namespace, config: Any) -> Any:
    from kubealign.feedback.client import connect

    return connect(args.url, config.feedback)


def push_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.feedback import pairs, push
    from kubealign.tracking.runs import check_uri, resolve_uri

    if args.count < 1:
        raise UserError(f"--count {args.count}: push at least one prompt")
    if (args.prompts is None) == (args.from_judge is None):
        raise UserError("give --prompts DIR|FILE (answers sampled here) or --from-judge DIR (what was served)")
    config = load_config(args.config, [])
    if args.from_judge is not None:
        client = connect(args, config)
        push_served(client, args.project, args.from_judge, config, args.model or config.promote.registered_model)
        return
    check_uri(args.tracking_uri, "--tracking-uri")
    uri = args.tracking_uri or resolve_uri(config)
    if not uri:
        raise UserError("--tracking-uri: no registry given (nor MLFLOW_TRACKING_URI, nor tracking.uri)")
    client = connect(args, config)
    prompts = push.held_out_prompts(args.prompts, args.count)
    name = args.model or config.promote.registered_model
    (first, first_dir), (second, second_dir) = push.registered_dirs(config.serve, uri, name, [args.first, args.second])
    sides = (pairs.Side(first.alias, first.version), pairs.Side(second.alias, second.version))
    comparisons = pairs.pairwise_tasks(
        prompts,
        push.answers(first_dir, prompts, config),
        push.answers(second_dir, prompts, config),
        sides,
        config.evaluate.seed,
        name,
    )
    done = push.push_tasks(client, args.project, comparisons)
    made = "created" if done.created else "found"
    print(f"feedback: project {args.project!r} ({made}, id {done.project}) at {client.url}")
    print(f"  {done.added} tasks added, {done.present} of the prompts were there already")
    print(f"  sides: {sides[0].label} and {sides[1].label}, shuffled per task")


def pull_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.feedback.pull import pull, track
    from kubealign.tracking.runs import resolve_uri

    if args.output.suffix != ".jsonl":
        raise UserError(f"--output {args.output}: write a .jsonl file (data.sources reads it)")
    if args.output.exists() or args.output.is_symlink():  # nothing the user owns is overwritten
        raise UserError(f"--output {args.output}: exists; pull into a new file")
    config = load_config(args.config, [])
    client = connect(args, config)
    written = pull(client, args.project, args.challenger, args.output, registry=resolve_uri(config))
    print("\n".join(written.lines))
    track(config, written, args.output, args.project, client.url, args.challenger)


def push_served(client: Any, project: str, judge_dir: Path, config: Any, model: str) -> Any:
    """The judge's served pairs chosen for this round pushed into `project`, what was done printed."""
    from kubealign.feedback.served import push_round

    done, _, lines = push_round(client, project, judge_dir, config, model)
    print("\n".join(lines))
    return done
