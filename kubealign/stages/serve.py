"""After promote, the DAG's optional `serve` task: the alias promote moved becomes what KServe serves.

Reads promote's result: when `serve.alias` (champion) points where it pointed before promote, nothing in the
cluster changes and the task says so; with promote.mode canary, a `challenger` promote moved is served beside
it instead, as the InferenceService's canary with canary.percent of the traffic. Otherwise the
InferenceService of the alias (kubealign.serving) is created or updated in the pipeline pod's namespace (or
serve.namespace) and the task waits until it is Ready for that spec (serve.ready_timeout_s). OUTPUT holds
result.json and the applied manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from kubealign.config import KubealignConfig
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.pod import POD_ENV, RUN_ID_ENV
from kubealign.promotion.aliases import CHALLENGER

STAGE = "serve"
NAMESPACE_ENV = POD_ENV["namespace"]  # the downward API's metadata.namespace (pipelines/dag.py)


def moved(promotion: dict[str, Any], alias: str) -> tuple[bool, Any]:
    """(did promote move `alias`, the version it names now). An alias promote does not manage counts as moved:
    promote cannot tell, and applying an unchanged manifest changes nothing."""
    after, before = promotion.get("aliases") or {}, promotion.get("aliases_before") or {}
    if alias not in after:
        return True, None
    return after[alias] is not None and after[alias] != before.get(alias), after[alias]


def run(config: KubealignConfig, promotion_dir: Path, output: Path, custom: Any = None) -> dict[str, Any]:
    """`custom`: a kubernetes CustomObjectsApi (default: the cluster this pod runs in)."""
    from kubealign.serving import deploy
    from kubealign.serving.manifest import with_pipeline_run
    from kubealign.serving.service import Canary, manifest_for
    from kubealign.tracking.runs import resolve_uri

    cfg = config.serve
    check_output_path(output, STAGE)
    promotion = read_result(promotion_dir)
    if promotion.get("stage") != "promote":
        raise UserError(f"--promotion {promotion_dir}: result.json is from stage {promotion.get('stage')!r}")
    changed, version = moved(promotion, cfg.alias)
    # promote.mode canary: a challenger promote made is served beside the alias, as its canary
    challenger_moved = config.promote.mode == "canary" and not changed and moved(promotion, CHALLENGER)[0]
    canary = Canary(CHALLENGER, config.canary.percent) if challenger_moved else None
    name = promotion.get("registered_model") or config.promote.registered_model
    if not changed and canary is None:
        why = f"promote did not move {cfg.alias} (version {version}): the served model stays as it is"
        print(f"serve: {why}", flush=True)
        with atomic_dir(output) as tmp:
            return write_result(tmp, STAGE, {"applied": 0.0}, {}, registered_model=name, applied=False, why=why)
    namespace = cfg.namespace or os.environ.get(NAMESPACE_ENV)
    if not namespace:
        raise UserError(f"serve.namespace: not set, and the pod's namespace is not in ${NAMESPACE_ENV}")
    uri = resolve_uri(config)
    if not uri:
        raise UserError("serve: no registry (MLFLOW_TRACKING_URI, tracking.uri) to read the alias from")
    body = manifest_for(cfg, uri, name, namespace, config.kubernetes.accelerator_type, canary)
    body = with_pipeline_run(body, os.environ.get(RUN_ID_ENV))  # the pod's pipeline/runid label
    if custom is None:
        from kubealign.cluster.trainjob import connect

        custom, _ = connect()
    where = f"InferenceService {namespace}/{body['metadata']['name']}"
    action = deploy.apply(custom, body)
    served = f"{name}@{cfg.alias}" + (f", canary @{canary.alias} at {canary.percent} %" if canary else "")
    print(f"serve: {where} {action} ({served}); waiting for Ready", flush=True)
    isvc = deploy.wait_ready(custom, body["metadata"]["name"], namespace, cfg.ready_timeout_s)
    url = (isvc.get("status") or {}).get("url")
    print(f"serve: {where} Ready at {url}", flush=True)
    with atomic_dir(output) as tmp:
        (tmp / "inferenceservice.yaml").write_text(yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
        annotations = body["metadata"]["annotations"]
        details = {"registered_model": name, "applied": True, "action": action, "url": url}
        details.update(version=annotations["kubealign.io/model-version"], inference_service=where)
        details["storage_uri"] = annotations["kubealign.io/storage-uri"]
        if canary:
            version = annotations["kubealign.io/canary-model-version"]
            details["canary"] = {"alias": canary.alias, "version": version, "percent": canary.percent}
        return write_result(tmp, STAGE, {"applied": 1.0}, {"manifest": "inferenceservice.yaml"}, **details)
