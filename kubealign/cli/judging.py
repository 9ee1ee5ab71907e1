"""The commands that decide which model is champion, each its parser beside its handler: evaluate (a candidate
against the SFT baseline, offline), promote (the registry's aliases moved if the gate passes), rollback (the
champion alias moved back, and what is served with it) and judge (a canary judged online, on its answers)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_config_options, add_functions_option, reward_functions
from kubealign.cli.training import add_verbose_option, quiet_libraries
from kubealign.errors import UserError


def add_parser(sub: Any) -> None:
    evaluate = sub.add_parser(
        "evaluate",
        help="stage 4: compare the PPO candidate with the SFT baseline on held-out prompts",
        description="Sample baseline and candidate on phase-3 eval prompts with the same seed, score both with "
        "the reward model and / or the reward functions (rewards.functions; their means as fn/NAME/baseline and "
        "fn/NAME/candidate); win-rate, KL, lengths, perplexity, sample table and plots.",
    )
    add_config_options(evaluate)
    add_verbose_option(evaluate)
    evaluate.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output")
    evaluate.add_argument("--baseline", required=True, type=Path, metavar="SFT_DIR", help="baseline model dir")
    evaluate.add_argument("--candidate", required=True, type=Path, metavar="PPO_DIR", help="candidate model dir")
    evaluate.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model dir (none with rewards.model_weight 0)"
    )
    evaluate.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    add_functions_option(evaluate)
    evaluate.set_defaults(func=evaluate_command)

    promote = sub.add_parser(
        "promote",
        help="stage 5: register the actor in the MLflow registry; move aliases if the gate passes",
        description="Register a model version (challenger); make it champion if it passes promote.* thresholds "
        "and beats the current champion. The old champion keeps previous-champion.",
    )
    add_config_options(promote)
    promote.add_argument("--evaluation", required=True, type=Path, metavar="EVAL_DIR", help="evaluate stage output")
    promote.add_argument("--model-dir", required=True, type=Path, metavar="PPO_DIR", help="the evaluated candidate")
    promote.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory (result.json)")
    promote.set_defaults(func=promote_command)
    rollback = sub.add_parser("rollback", help="move the champion alias back to previous-champion")
    add_config_options(rollback)
    rollback.add_argument(
        "--namespace", metavar="NS", help="also serve that champion there (its InferenceService applied, no canary)"
    )
    rollback.set_defaults(func=rollback_command)
    _add_judge(sub)


def _add_judge(sub: Any) -> None:
    judge = sub.add_parser(
        "judge",
        help="judge a canary online: the same held-out prompts to the champion's and the canary's servers",
        description="Send the first canary.prompts phase-3 prompts to both OpenAI-compatible servers (greedy), "
        "count every failed request, score the answers both gave as evaluate scores samples and compare them, the "
        "champion as the baseline; decide by canary.min_answers, canary.max_error_rate, canary.max_latency_p95_s "
        "and the promote gate on the online numbers. Writes result.json, answers.json, judge.md.",
    )
    add_config_options(judge)
    add_verbose_option(judge)
    judge.add_argument("--champion", metavar="URL", help="the champion's server (http://host:port)")
    judge.add_argument("--canary", metavar="URL", help="the canary's server")
    judge.add_argument(
        "--front",
        metavar="URL",
        help="instead of --champion/--canary: the front of `kubealign serve --canary` (both servers behind it); "
        "with --act the verdict is served there too",
    )
    judge.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output")
    judge.add_argument(
        "--tokenizer", required=True, type=Path, metavar="DIR", help="the policy's tokenizer (a model dir)"
    )
    judge.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model dir (none with rewards.model_weight 0)"
    )
    judge.add_argument(
        "--served-name", metavar="NAME", help="model name on both servers (default: promote.registered_model)"
    )
    judge.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    judge.add_argument(
        "--act",
        action="store_true",
        help="carry out the verdict in the registry ($MLFLOW_TRACKING_URI): challenger becomes champion, or is "
        "cleared and tagged rejected",
    )
    judge.add_argument(
        "--namespace", metavar="NS", help="with --act: also serve the champion alone there (the canary removed)"
    )
    judge.set_defaults(func=judge_command)


def evaluate_command(args: argparse.Namespace) -> None:
    from kubealign.cli.summary import evaluate_lines
    from kubealign.config import load_config
    from kubealign.stages import evaluate

    quiet_libraries(args.verbose)
    config = load_config(args.config, args.overrides)
    result = evaluate.run(
        config, args.prompts, args.baseline, args.candidate, args.reward, args.output, functions=reward_functions(args)
    )
    m = result["metrics"]
    print(f"evaluate: {result['output']}  ({m['prompts']} prompts)")
    for line in evaluate_lines(m):
        print(f"  {line}")
    print(f"  length drift {m['length_drift']:.2f}, samples: {Path(result['output']) / 'samples.html'}")


def promote_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import promote

    result = promote.run(load_config(args.config, args.overrides), args.evaluation, args.model_dir, args.output)
    print(f"promote: {result['registered_model']} version {result['version']}; aliases {result['aliases']}")
    for line in result["gate"]:
        print(f"  {line}")
    if result.get("refusal"):
        print(result["refusal"])


def rollback_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import promote

    config = load_config(args.config, args.overrides)
    state = promote.rollback(config)
    print(f"rollback: champion is version {state['champion']} again (was {state['rolled_back_from']})")
    if args.namespace:  # the served model follows the registry: the champion's InferenceService, no canary
        from kubealign.cluster.trainjob import connect
        from kubealign.serving import carry_out
        from kubealign.tracking.runs import resolve_uri

        custom, _ = connect()
        action = carry_out.in_serving(config, resolve_uri(config), args.namespace, custom)
        print(f"rollback: InferenceService {args.namespace}: {action}, Ready")


def _judged_urls(args: argparse.Namespace, config: Any) -> tuple[str, str, str, str | None]:
    """(champion URL, canary URL, the judged version, the registry's URI with --act).

    --front: the local split's backends; the judged version is its canary's. A rerun after a crash between
    the registry and the front finds `challenger` already cleared: the front's canary version is then the one
    the verdict was about, and aliases.verdict_plan finds the registry already as it wants (or refuses)."""
    from kubealign.serving import carry_out, split

    if args.front and (args.champion or args.canary):
        raise UserError("--front: the local split names both servers; give it or --champion and --canary")
    if not args.front and not (args.champion and args.canary):
        raise UserError("give --front URL (kubealign serve --canary) or both --champion URL and --canary URL")
    if args.namespace and not args.act:
        raise UserError("--namespace: only with --act (the served model changes only when the verdict is acted on)")
    if args.front and args.namespace:
        raise UserError("--namespace: the cluster's service, --front: the local one; give one")
    if not args.front:
        return args.champion, args.canary, *_judged_in_cluster(args, config)
    route = split.read_route(args.front)
    if route["canary"] is None:
        raise UserError(f"--front {args.front}: serves version {route['stable']['version']} alone: no canary to judge")
    version = str(route["canary"]["version"])
    uri = None
    if args.act:  # challenger None: cleared already, the rerun of a verdict carried out halfway
        uri, challenger = carry_out.judged_version(config, required=False)
        if challenger not in (None, version):
            raise UserError(f"--front {args.front}: its canary is version {version}, challenger is {challenger}")
    return route["stable"]["url"], route["canary"]["url"], version, uri


def _champion_version(args: argparse.Namespace, config: Any, canary: str, uri: str | None) -> str:
    """The version the champion's server was judged as (result.json's versions, which feedback push --from-judge
    names on each task): the local split's stable one; with --act the registry's (the one its server was checked
    against); else "?" (no registry read: such a push is refused)."""
    from kubealign.serving import identity, split

    if args.front:
        return str(split.read_route(args.front)["stable"]["version"])
    if uri is None:
        return "?"
    return str(identity.expected_versions(uri, config.promote.registered_model, canary)["champion"])


def _judged_in_cluster(args: argparse.Namespace, config: Any) -> tuple[str, str | None]:
    """(the judged version, the registry's URI with --act): `challenger`'s, or, with --namespace where it is
    cleared already (the rerun of a verdict carried out halfway), the InferenceService's canary's."""
    from kubealign.serving import carry_out

    if not args.act:
        return "?", None
    uri, version = carry_out.judged_version(config, required=not args.namespace)
    if version is None:
        from kubealign.cluster.trainjob import connect

        name = config.promote.registered_model
        version = carry_out.served_canary(connect()[0], args.namespace, name)
        if version is None:
            raise UserError(f"judge --act: {name} has no challenger alias and its InferenceService no canary")
    return version, uri


def _served_versions(args: argparse.Namespace, config: Any, urls: dict[str, str], version: str, uri: str | None):
    """The check that each URL serves the version the registry says (kubealign.serving.identity), before any
    prompt. Without --act no registry is read (the judge never needed one to report): said, not failed."""
    from kubealign.serving import identity

    if uri is None:
        lines = identity.unchecked("judged without --act, the registry is not read")
        print(f"judge: {lines[0]}", flush=True)
        return lines
    name = config.promote.registered_model
    expected = identity.expected_versions(uri, name, version)
    return identity.check(urls, expected, name, dict.fromkeys(urls, args.served_name or name))


def judge_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.serving import carry_out
    from kubealign.stages import judge

    quiet_libraries(args.verbose)
    config = load_config(args.config, args.overrides)
    champion, canary, version, uri = _judged_urls(args, config)
    checked = _served_versions(args, config, {"champion": champion, "canary": canary}, version, uri)
    inputs = (args.prompts, args.tokenizer, args.reward, champion, canary, args.output, args.served_name)
    from kubealign.feedback import fresh, lookup
    from kubealign.tracking.runs import resolve_uri

    # people's verdict (canary.min_human_win_rate) and the judges' agreement with them (min_judge_agreement)
    human, agreement = lookup.people(uri or resolve_uri(config), config, version)
    agreement = {**agreement, **fresh.of_reward_dir(args.reward)}  # the scorer's own check against people, if any
    more = {"champion_version": _champion_version(args, config, version, uri), "agreement": agreement}
    result = judge.run(config, *inputs, version, tuple(checked), human, **more)
    print(f"  checks and figures: {Path(result['output']) / 'judge.md'}")
    if not args.act:
        return
    if result.get("awaiting_people"):  # canary.await_people: nothing moves until people decide
        print("  registry and serving unchanged: judge --act again once people have decided on it")
        return
    after = carry_out.in_registry(config, uri, result["promoted"], version)
    print(f"  registry: {', '.join(f'{a} = {v}' for a, v in after.items())}")
    if args.front:
        print(
            f"  serving: {args.front} {carry_out.in_local(config, uri, args.front)}: version {after['champion']} alone"
        )
    if args.namespace:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
        print(f"  serving: InferenceService {carry_out.in_serving(config, uri, args.namespace, custom)}, Ready")
