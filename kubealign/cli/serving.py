"""`kubealign serve`: a registry alias served here with vLLM's OpenAI-compatible server (a canary beside it
behind a front), or its KServe InferenceService's manifest written; its parser beside its handler. Judging
a served canary and rolling back: kubealign.cli.judging."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign.cli.options import add_config_options
from kubealign.errors import UserError


def add_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a registry alias here with vLLM's OpenAI server, or write its KServe InferenceService",
        description="Resolve ALIAS of the registered model to its version and check that version's Hugging Face "
        "directory (config, safetensors, tokenizer). Without --manifest: serve it on 127.0.0.1:PORT with vLLM's "
        "OpenAI-compatible server (the runtime KServe runs; its venv is created on first use). With --manifest: "
        "write the InferenceService (serving.kserve.io/v1beta1) whose storageUri is that directory in the artifact "
        "store (serve.artifacts_destination for a server that serves its artifacts). Settings: the serve section.",
    )
    add_config_options(serve)
    serve.add_argument("--tracking-uri", metavar="URI", help="the registry (default: $MLFLOW_TRACKING_URI)")
    serve.add_argument("--model", metavar="NAME", help="registered model (default: promote.registered_model)")
    serve.add_argument("--alias", metavar="ALIAS", help="the alias served (default: serve.alias, champion)")
    serve.add_argument("--namespace", metavar="NS", help="namespace of the InferenceService (default: serve.namespace)")
    serve.add_argument(
        "--manifest", type=Path, metavar="FILE", help="write the InferenceService here instead of serving here"
    )
    serve.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000), without --manifest")
    serve.add_argument(
        "--canary",
        metavar="ALIAS",
        help="serve this alias (e.g. challenger) beside --alias with its share of the traffic: here, both servers "
        "behind a front on --port; with --manifest, as the InferenceService's canary",
    )
    serve.add_argument(
        "--canary-percent",
        type=int,
        metavar="N",
        help="the canary's share of the traffic, 1-99 %% (default: canary.percent, 10)",
    )
    serve.set_defaults(func=serve_command)


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
