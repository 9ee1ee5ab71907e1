"""The serving commands of `kubealign`: serve (here, or the InferenceService's manifest), judge (a canary
online) and rollback (the registry, and what is served with it)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign.errors import UserError


def _judged_urls(args: argparse.Namespace, config: Any) -> tuple[str, str, str, str | None]:
    """(champion URL, canary URL, the judged version, the registry's URI with --act).

    --front: the local split's backends; the judged version is its canary's. A rerun after a crash between
    the registry and the front finds `challenger` already cleared: the front's canary version is then the one
    the verdict was about, and aliases.verdict_plan finds the registry already as it wants (or refuses)."""
    from kubealign.serving import act, split

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
        uri, challenger = act.judged_version(config, required=False)
        if challenger not in (None, version):
            raise UserError(f"--front {args.front}: its canary is version {version}, challenger is {challenger}")
    return route["stable"]["url"], route["canary"]["url"], version, uri


def _judged_in_cluster(args: argparse.Namespace, config: Any) -> tuple[str, str | None]:
    """(the judged version, the registry's URI with --act): `challenger`'s, or, with --namespace where it is
    cleared already (the rerun of a verdict carried out halfway), the InferenceService's canary's."""
    from kubealign.serving import act

    if not args.act:
        return "?", None
    uri, version = act.judged_version(config, required=not args.namespace)
    if version is None:
        from kubealign.cluster.trainjob import connect

        name = config.promote.registered_model
        version = act.served_canary(connect()[0], args.namespace, name)
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
    from kubealign.serving import act
    from kubealign.stages import judge

    config = load_config(args.config, args.overrides)
    champion, canary, version, uri = _judged_urls(args, config)
    checked = _served_versions(args, config, {"champion": champion, "canary": canary}, version, uri)
    inputs = (args.prompts, args.tokenizer, args.reward, champion, canary, args.output, args.served_name)
    human = None
    if config.canary.min_human_win_rate is not None:  # people's verdict on this version (kubealign feedback pull)
        from kubealign.feedback import lookup

        human = lookup.latest(uri, config.tracking.experiment, version)
    result = judge.run(config, *inputs, version, tuple(checked), human)
    print(f"  checks and figures: {Path(result['output']) / 'judge.md'}")
    if not args.act:
        return

    after = act.in_registry(config, uri, result["promoted"], version)
    print(f"  registry: {', '.join(f'{a} = {v}' for a, v in after.items())}")
    if args.front:
        print(f"  serving: {args.front} {act.in_local(config, uri, args.front)}: version {after['champion']} alone")
    if args.namespace:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
        print(f"  serving: InferenceService {act.in_serving(config, uri, args.namespace, custom)}, Ready")


def rollback_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.stages import promote

    config = load_config(args.config, args.overrides)
    state = promote.rollback(config)
    print(f"rollback: champion is version {state['champion']} again (was {state['rolled_back_from']})")
    if args.namespace:  # the served model follows the registry: the champion's InferenceService, no canary
        from kubealign.cluster.trainjob import connect
        from kubealign.serving import act
        from kubealign.tracking.runs import resolve_uri

        custom, _ = connect()
        action = act.in_serving(config, resolve_uri(config), args.namespace, custom)
        print(f"rollback: InferenceService {args.namespace}: {action}, Ready")


def serve_command(args: argparse.Namespace) -> None:
    from kubealign.config import load_config
    from kubealign.serving.service import Canary, manifest_for, write_manifest
    from kubealign.tracking.runs import check_uri, resolve_uri

    config = load_config(args.config, args.overrides)
    check_uri(args.tracking_uri, "--tracking-uri")
    uri = args.tracking_uri or resolve_uri(config)
    if not uri:
        raise UserError("--tracking-uri: no registry given (nor MLFLOW_TRACKING_URI, nor tracking.uri)")
    cfg = config.serve.model_copy(update={"alias": args.alias} if args.alias else {})
    name = args.model or config.promote.registered_model
    percent = canary_percent(args, cfg, config.canary.percent)
    canary = Canary(args.canary, percent) if args.canary else None
    if args.manifest is None:
        from kubealign.serving import local

        local.serve(cfg, uri, name, args.port, canary)
        return
    namespace = args.namespace or cfg.namespace or "default"
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


def canary_percent(args: argparse.Namespace, cfg: Any, default: int) -> int:
    """--canary-percent (or canary.percent), checked; --canary needs another alias."""
    if args.canary_percent is not None and not args.canary:
        raise UserError("--canary-percent: give --canary ALIAS, the alias that gets that share")
    if args.canary is not None and args.canary == cfg.alias:
        raise UserError(f"--canary {args.canary}: that is the alias served (--alias); name another, e.g. challenger")
    percent = default if args.canary_percent is None else args.canary_percent
    if not 1 <= percent <= 99:
        raise UserError(f"--canary-percent {percent}: a share from 1 to 99 (100 is promotion, 0 no canary)")
    return percent
