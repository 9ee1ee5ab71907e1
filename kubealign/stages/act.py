"""The DAG's optional `act` task, after `judge` with canary.act (the default): the judge's verdict carried out.

Reads the judge task's verdict.json (kubealign.stages.judge_task.VERDICT_FILE) and makes it true as `kubealign
judge --act --namespace` does (kubealign.serving.carry_out): the registry's aliases under promote's lease and journal,
then the InferenceService (the champion alone), waiting for Ready. It runs no user code, so its pod holds the
pipeline identity, the one that may move `champion`; the judge, which runs the reward functions, holds the
tracking identity (kubealign.cluster.secrets). A crash between the registry and the cluster is finished by
running this task again (`kubealign rerun act`): it finds the registry as the verdict wants it, moves nothing
and finishes the service. A verdict file that is not the judge's whole verdict is refused in one line naming it,
and so is one about another InferenceService than this run's (serve.namespace or the pod's own namespace, and
the name the serve task gives): the judge runs user code, so the namespace and the name come from the config,
never from the verdict, and nothing is moved or applied before they match.
OUTPUT: result.json (the aliases after, the InferenceService and what was done to it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.errors import UserError, first_line
from kubealign.outputs import atomic_dir, check_output_path, write_result
from kubealign.pod import POD_ENV
from kubealign.stages.judge_task import VERDICT_FILE

STAGE = "act"
SERVICE = re.compile(r"[^/\s]+/[^/\s]+")  # NAMESPACE/NAME
NAMESPACE_ENV = POD_ENV["namespace"]  # as the serve task reads it (kubealign.stages.serve)
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def read_verdict(judgement: Path, registered_model: str) -> dict[str, Any]:
    """The judge task's verdict in `judgement`, checked whole (kubealign.stages.judge_task.VERDICT_FILE)."""
    path = judgement / VERDICT_FILE
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file: the judge task writes it last; judge again") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not a verdict: invalid JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a verdict: {first_line(exc)}") from None
    problem = verdict_problem(verdict, registered_model)
    if problem is not None:
        raise UserError(f"{path}: not a verdict: {problem}")
    return verdict


def verdict_problem(verdict: Any, registered_model: str) -> str | None:
    """What is wrong with a verdict (None: nothing)."""
    if not isinstance(verdict, dict):
        return f"a JSON {type(verdict).__name__}, not an object"
    if not isinstance(verdict.get("judged"), bool):
        return f'"judged" is {verdict.get("judged")!r}, not true or false'
    if not verdict["judged"]:
        return None
    if not isinstance(verdict.get("awaiting_people", False), bool):
        return f'"awaiting_people" is {verdict.get("awaiting_people")!r}, not true or false'
    if not isinstance(verdict.get("promoted"), bool):
        return f'"promoted" is {verdict.get("promoted")!r}, not true or false'
    version = verdict.get("version")
    if not isinstance(version, str) or not re.fullmatch(r"[0-9]+", version):
        return f'"version" is {version!r}, not a registered version number'
    named = verdict.get("registered_model")
    if named != registered_model:
        return f'"registered_model" is {named!r}, not promote.registered_model {registered_model!r}'
    service = verdict.get("inference_service")
    if not isinstance(service, str) or not SERVICE.fullmatch(service):
        return f'"inference_service" is {service!r}, not NAMESPACE/NAME'
    return None


def pod_namespace() -> str | None:
    """The namespace this pod runs in: the downward API's variable when the DAG sets it, else the service
    account's mount (any pod that reaches the cluster in-cluster has it); None outside a pod."""
    named = os.environ.get(NAMESPACE_ENV)
    if named:
        return named
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def served_service(config: KubealignConfig) -> tuple[str, str]:
    """(namespace, NAMESPACE/NAME) of the InferenceService this run's serve task makes: serve.namespace or the pod's
    own, serve.name or the registered model's DNS name."""
    from kubealign.serving.manifest import dns_name

    namespace = config.serve.namespace or pod_namespace()
    if not namespace:
        where = f"${NAMESPACE_ENV}, {SERVICE_ACCOUNT_NAMESPACE}"
        raise UserError(f"serve.namespace: not set, and the pod's namespace is unknown ({where})")
    return namespace, f"{namespace}/{config.serve.name or dns_name(config.promote.registered_model)}"


def own_service(config: KubealignConfig, judgement: Path, named: str) -> tuple[str, str]:
    """served_service(), refused when the verdict names another InferenceService: the judge
    runs user code, so its verdict may say anything."""
    namespace, ours = served_service(config)
    if named != ours:
        raise UserError(
            f"{judgement / VERDICT_FILE}: the verdict is about InferenceService {named}, but this run serves "
            f"{ours} (serve.namespace, serve.name): nothing was carried out"
        )
    return namespace, ours


def run(config: KubealignConfig, judgement: Path, output: Path, custom: Any = None) -> dict[str, Any]:
    """judgement: the judge task's output; custom: a kubernetes CustomObjectsApi (default: the cluster this pod
    runs in)."""
    from kubealign.tracking.runs import resolve_uri

    check_output_path(output, STAGE)
    verdict = read_verdict(judgement, config.promote.registered_model)
    why = None
    if not verdict["judged"]:
        why = f"nothing to carry out: {verdict.get('why') or 'nothing was judged'}"
    elif not config.canary.act:  # the run's config_json says so, whatever the pipeline was compiled with
        why = "canary.act is false: the verdict is reported, not carried out"
    elif verdict.get("awaiting_people"):
        why = (
            f"version {verdict['version']} awaits people's choices (canary.await_people): it keeps serving its share; "
            "the pipeline's next run settles it"
        )
    if why is not None:
        print(f"act: {why}", flush=True)
        with atomic_dir(output) as tmp:
            return write_result(tmp, STAGE, {"acted": 0.0}, {}, acted=False, why=why)
    uri = resolve_uri(config)
    if not uri:
        raise UserError("act: no registry (MLFLOW_TRACKING_URI, tracking.uri) to carry the verdict out in")
    namespace, service = own_service(config, judgement, verdict["inference_service"])
    promoted, version = verdict["promoted"], verdict["version"]
    details = carry(config, uri, namespace, service, promoted, version, custom)
    details["verdict"] = verdict.get("verdict", "")
    with atomic_dir(output) as tmp:
        return write_result(tmp, STAGE, {"acted": 1.0, "promoted": float(promoted)}, {}, acted=True, **details)


def carry(
    config: KubealignConfig,
    uri: str,
    namespace: str,
    service: str,
    promoted: bool,
    version: str,
    custom: Any,
    stage: str = STAGE,
) -> dict[str, Any]:
    """A verdict on `version` carried out: the registry's aliases, then the InferenceService `service` in
    `namespace` (custom: a CustomObjectsApi, None: this pod's cluster; stage: the task that says so, as
    kubealign.stages.settle carries verdicts out too); what was done, as result.json says it."""
    from kubealign.serving import carry_out

    after = carry_out.in_registry(config, uri, promoted, version)
    registry = ", ".join(f"{alias} = {value}" for alias, value in after.items())
    print(f"{stage}: registry {registry}", flush=True)
    if custom is None:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
    action = carry_out.in_serving(config, uri, namespace, custom)
    summary = f"registry {registry}; InferenceService {service} {action}, Ready"
    print(f"{stage}: InferenceService {service} {action}, Ready", flush=True)
    return {
        "promoted": promoted,
        "version": version,
        "registry": after,
        "inference_service": service,
        "action": action,
        "summary": summary,
    }
