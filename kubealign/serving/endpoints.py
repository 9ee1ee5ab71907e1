"""Each predictor of a canaried InferenceService by its own address, for the online judge in the cluster:
the judge asks the stable model and the canary the same prompts, so it cannot go through the
service's URL, which splits them by share.

kubealign's manifest labels each predictor (KServe copies a component's `labels` onto its pods):
`kubealign.io/inference-service` (the service's name), `kubealign.io/predictor` (stable | canary) and
`kubealign.io/model-version`. A predictor's address is then a Ready pod of it serving the expected version
(during a rollout old pods still run), at the port its model container declares (the runtime's: 8080 in
KServe's vllm and huggingface runtimes). This reads pods only, never KServe's own naming of canary Services.
"""

from __future__ import annotations

from typing import Any

from kubealign.errors import UserError, first_line

PREFIX = "kubealign.io"
SERVICE_LABEL, ROLE_LABEL, VERSION_LABEL = (
    f"{PREFIX}/inference-service",
    f"{PREFIX}/predictor",
    f"{PREFIX}/model-version",
)
STABLE, CANARY = "stable", "canary"
DEFAULT_PORT = 8080  # KServe's runtimes start their server with --port=8080 (runtime-kserve-*.yaml)


def predictor_labels(service: str, role: str, version: str) -> dict[str, str]:
    """The labels a predictor's pods carry (values as manifest.label_value keeps them)."""
    return {SERVICE_LABEL: service, ROLE_LABEL: role, VERSION_LABEL: version}


def _ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _port(pod: dict[str, Any]) -> int:
    """The first port the model container (kserve-container) declares; the runtimes' 8080 when none."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == "kserve-container":
            for port in container.get("ports") or []:
                if port.get("containerPort"):
                    return int(port["containerPort"])
    return DEFAULT_PORT


def pick(pods: list[dict[str, Any]], version: str) -> str | None:
    """http://IP:PORT of the first (by name) Ready pod that serves `version`; None when there is none."""
    serving = [
        p
        for p in pods
        if _ready(p)
        and (p.get("metadata", {}).get("labels") or {}).get(VERSION_LABEL) == version
        and (p.get("status") or {}).get("podIP")
    ]
    if not serving:
        return None
    pod = min(serving, key=lambda p: p["metadata"]["name"])
    return f"http://{pod['status']['podIP']}:{_port(pod)}"


def predictor_url(core: Any, namespace: str, service: str, role: str, version: str) -> str:
    """The address of `service`'s `role` predictor serving `version`; one line when there is none."""
    selector = f"{SERVICE_LABEL}={service},{ROLE_LABEL}={role}"
    try:
        listed = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
    except Exception as exc:  # the kubernetes client raises ApiException / urllib3 errors
        status = getattr(exc, "status", None)
        raise UserError(f"listing pods {selector} in {namespace}: HTTP {status} {first_line(exc)}") from None
    import json

    url = pick(json.loads(listed.data).get("items") or [], version)
    if url is None:
        raise UserError(f"judge: no Ready pod of {namespace}/{service}'s {role} predictor serves version {version}")
    return url
