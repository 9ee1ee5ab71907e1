"""`kubealign registry`: what the chart's MLflow pods run for authentication, its basic-auth config file
(auth-config) and its identities (identities); kubealign.cluster.registry_auth does the work."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign.errors import UserError


def add_parser(sub: Any) -> None:
    registry = sub.add_parser(
        "registry",
        help="the chart's MLflow with authentication: its config file and its identities (run by the chart's pods)",
        description="auth-config writes MLflow's basic-auth ini for the database in $MLFLOW_AUTH_DATABASE_URI; "
        "identities signs in as the admin (MLFLOW_TRACKING_USERNAME / _PASSWORD) and creates the pipeline, tracker "
        "and reader identities from KUBEALIGN_PIPELINE_, KUBEALIGN_TRACKER_ and KUBEALIGN_READER_USERNAME / _PASSWORD "
        "(or sets their passwords again). docs/reliability.md 'Trust boundaries'.",
    )
    registry_sub = registry.add_subparsers(dest="registry_command", metavar="ACTION", required=True)
    auth_config = registry_sub.add_parser("auth-config", help="write the basic-auth ini (MLFLOW_AUTH_CONFIG_PATH)")
    auth_config.add_argument("--output", required=True, type=Path, metavar="FILE", help="the ini file to write")
    identities = registry_sub.add_parser("identities", help="create the pipeline, tracker and reader identities")
    identities.add_argument("--tracking-uri", required=True, metavar="URL", help="the MLflow server")
    identities.add_argument(
        "--wait", type=float, default=300.0, metavar="S", help="seconds to wait for the server to answer (default 300)"
    )
    identities.add_argument(
        "--registered-model",
        action="append",
        default=[],
        metavar="NAME",
        help="a registered model the pipeline promotes to: created if absent, the pipeline identity's (MANAGE), "
        "the tracker's and the reader's to read only (repeatable)",
    )
    identities.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="NAME",
        help="an experiment the pipeline logs to (tracking.experiment): created if absent, the pipeline identity's "
        "(MANAGE), the tracker may log runs in it (EDIT), the reader reads (repeatable)",
    )

    registry.set_defaults(func=registry_command)


def registry_command(args: argparse.Namespace) -> None:
    from kubealign.cluster import registry_auth

    if args.registry_command == "auth-config":
        registry_auth.write_config(args.output)
        print(f"registry: basic-auth config written to {args.output}")
        return
    wanted = registry_auth.identities()
    if not wanted:
        raise UserError(
            "no identity to create: set KUBEALIGN_PIPELINE_USERNAME / _PASSWORD (and the tracker's, the reader's)"
        )
    registry_auth.wait_until_up(args.tracking_uri, args.wait)
    for line in registry_auth.ensure(args.tracking_uri, wanted):
        print(f"registry: {line}")
    for line in registry_auth.claim_models(args.tracking_uri, args.registered_model, wanted):
        print(f"registry: {line}")
    for line in registry_auth.claim_experiments(args.tracking_uri, args.experiment, wanted):
        print(f"registry: {line}")
