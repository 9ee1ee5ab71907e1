"""Put the InferenceService in the cluster and wait until it is Ready (the DAG's serve task).

Create when absent, else a merge patch of its labels, annotations and spec that carries the resourceVersion
read just before: idempotent (the same manifest twice changes nothing), and a concurrent writer's change is
a 409, not silently overwritten. (kubernetes 30's client sends custom-object patches as merge patches only;
server-side apply would need raw calls.) Ready is the Ready condition with status "True" for this spec's
generation (status.observedGeneration, where KServe reports it), so a Ready left from the previous spec does
not count. Every API error is one line naming the object and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubealign.errors import UserError
from kubealign.serving.manifest import GROUP, PLURAL, VERSION

HINTS = {
    401: "the pod's credentials were refused",
    403: "the pipeline's ServiceAccount may not manage InferenceServices there: the chart's Role grants it "
    "(serve.rbac in charts/kubealign)",
    404: "no InferenceService API: is KServe installed in the cluster?",
    409: "it changed while kubealign updated it: rerun the serve task",
    422: "the cluster refused the manifest",
}


MANAGED = ("canary",)  # the optional spec fields kubealign writes: absent from a new spec means removed


def _api_error(exc: Any, what: str) -> UserError:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or type(exc).__name__
    hint = HINTS.get(status, "")
    return UserError(f"{what}: HTTP {status} {reason}" + (f" ({hint})" if hint else ""))


def apply(custom: Any, body: dict[str, Any]) -> str:
    """Create or update; "created", "updated" or "unchanged"."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    where = f"InferenceService {namespace}/{name}"
    try:
        current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except Exception as exc:
        if getattr(exc, "status", None) != 404:
            raise _api_error(exc, f"reading {where}") from None
        current = None
    if current is None:
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        except Exception as exc:
            raise _api_error(exc, f"creating {where}") from None
        return "created"
    old = current.get("metadata", {})
    same = (
        current.get("spec") == body["spec"]
        and all(old.get("labels", {}).get(k) == v for k, v in meta["labels"].items())
        and all(old.get("annotations", {}).get(k) == v for k, v in meta["annotations"].items())
    )
    if same:
        return "unchanged"
    # A merge patch keeps what it does not name: a canary the new spec no longer has is removed by a null.
    spec = {**{key: None for key in MANAGED if key in (current.get("spec") or {})}, **body["spec"]}
    patch = {
        "metadata": {
            "labels": meta["labels"],
            "annotations": meta["annotations"],
            "resourceVersion": old.get("resourceVersion"),
        },
        "spec": spec,
    }
    try:
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
    except Exception as exc:
        raise _api_error(exc, f"updating {where}") from None
    return "updated"


def ready(isvc: dict[str, Any]) -> tuple[bool, str]:
    """(Ready for its current generation, the Ready condition's message or why not)."""
    status = isvc.get("status") or {}
    generation = (isvc.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and observed is not None and observed < generation:
        return False, f"the controller has not seen generation {generation} yet"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            message = condition.get("message") or condition.get("reason") or ""
            return condition.get("status") == "True", message
    return False, "no Ready condition yet"


def wait_ready(
    custom: Any,
    name: str,
    namespace: str,
    timeout_s: float,
    poll_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll until Ready; the InferenceService. Past timeout_s: one line with the last reason (it stays)."""
    where, start = f"InferenceService {namespace}/{name}", clock()
    while True:
        try:
            isvc = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except Exception as exc:
            raise _api_error(exc, f"reading {where}") from None
        ok, why = ready(isvc)
        if ok:
            return isvc
        if clock() - start > timeout_s:
            raise UserError(f"{where} not Ready after {timeout_s:.0f} s (serve.ready_timeout_s): {why or 'no reason'}")
        sleep(poll_s)
