"""The online judge's verdict carried out: first in the registry, then in what is served. Called by
`kubealign judge --act` and, in the DAG, by the act task (kubealign.stages.act) on the judge task's verdict.json.

Registry, under promote's lease and alias journal (kubealign.promotion): a promoted canary's version becomes
`champion` (the old one kept as `previous-champion`) and `challenger` is cleared; a rolled-back one loses
`challenger` and is tagged `kubealign.online=rejected`, only when this call takes the alias from it (a verdict
about a version that is not `challenger`, forged or a rerun's, tags nothing). Serving, after that: the
InferenceService is made again from the registry as it now is (the champion's files, no canary) and applied,
and the task waits for Ready. A crash between the two leaves the registry decided and the service still
splitting traffic; the rerun finds the registry already as the verdict wants it, moves nothing and finishes the
service. A verdict on a version that is no longer `challenger` (another promotion since) is refused: judge
again. Here (the local split of `kubealign serve --canary`, kubealign.serving.split) serving follows the
registry the same way: the champion's version is made the front's whole service and `kubealign serve` stops the
other server.
"""

from __future__ import annotations

from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError, first_line
from kubealign.promotion.aliases import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS,
    REGISTRY_HTTP,
    move_aliases,
    read_state,
    recover,
    registry_errors,
    verdict_plan,
)

REJECTED_TAG = "kubealign.online"


def judged_version(config: KubealignConfig, required: bool = True) -> tuple[str, str | None]:
    """(the registry's URI, the version `challenger` names now): what a verdict will be about. None (when not
    `required`) where no version holds it."""
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import resolve_uri

    uri = resolve_uri(config)
    if not uri:
        raise UserError("judge --act: set MLFLOW_TRACKING_URI (or tracking.uri) to the registry to act in")
    name = config.promote.registered_model
    with registry_errors(uri):
        version = read_state(MlflowClient(uri), name)[0].get(CHALLENGER)
    if version is None and required:
        raise UserError(f"judge --act: {name} has no {CHALLENGER} alias: nothing is being judged")
    return uri, version


def in_registry(config: KubealignConfig, uri: str, promoted: bool, version: str) -> dict[str, Any]:
    """Move the aliases (or find them moved); the aliases after."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.lease import lease
    from kubealign.tracking.runs import http_settings

    name = config.promote.registered_model
    with http_settings(REGISTRY_HTTP), registry_errors(uri):
        client = MlflowClient(uri)
        with lease(client, uri, name):
            aliases = recover(client, uri, name)
            plan = verdict_plan(promoted, version, aliases)
            if plan is None:
                now = aliases.get(CHALLENGER)
                raise UserError(
                    f"judge: {name} {CHALLENGER} is now version {now}, not the judged version {version}: judge again"
                )
            if not promoted and aliases.get(CHALLENGER) == version and (CHALLENGER, None) in plan:
                # only the version this call takes `challenger` from: a verdict about any other (a forged one, or
                # a rerun's once the alias is gone) moves nothing and so marks nothing
                client.set_model_version_tag(name, version, REJECTED_TAG, "rejected")
            move_aliases(client, uri, name, aliases, plan)
            after, _ = read_state(client, name)
    return {alias: after.get(alias) for alias in (CHALLENGER, CHAMPION, PREVIOUS)}


def in_serving(config: KubealignConfig, uri: str, namespace: str, custom: Any) -> str:
    """The champion's InferenceService, no canary, applied; waits for Ready; "created" / "updated" / "unchanged"."""
    from kubealign.serving import deploy
    from kubealign.serving.service import manifest_for

    cfg = config.serve.model_copy(update={"alias": CHAMPION})
    body = manifest_for(cfg, uri, config.promote.registered_model, namespace, config.kubernetes.accelerator_type)
    action = deploy.apply(custom, body)
    deploy.wait_ready(custom, body["metadata"]["name"], namespace, cfg.ready_timeout_s)
    return action


def in_local(config: KubealignConfig, uri: str, front: str) -> str:
    """The registry's champion made the local front's whole service: "updated" / "unchanged"."""
    from mlflow.tracking import MlflowClient

    from kubealign.serving import split

    name = config.promote.registered_model
    with registry_errors(uri):
        champion = read_state(MlflowClient(uri), name)[0].get(CHAMPION)
    if champion is None:
        raise UserError(f"judge --act: {name} has no {CHAMPION} alias: nothing to serve alone")
    return split.serve_only(front, champion)


def served_canary(custom: Any, namespace: str, name: str) -> str | None:
    """The version the InferenceService of `name` serves as its canary now (None: no canary, or no service):
    what a rerun judges once its first run cleared `challenger` and crashed before the service changed."""
    from kubealign.serving.manifest import GROUP, PLURAL, VERSION, dns_name

    try:
        isvc = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, dns_name(name))
    except Exception as exc:
        if getattr(exc, "status", None) == 404:
            return None
        raise UserError(f"reading InferenceService {namespace}/{dns_name(name)}: {first_line(exc)}") from None
    if not (isvc.get("spec") or {}).get("canary"):
        return None
    return (isvc.get("metadata", {}).get("annotations") or {}).get("kubealign.io/canary-model-version")
