"""The InferenceService (serving.kserve.io/v1beta1, KServe v0.20) that serves a registry alias. Pure.

The predictor names a model format and the runtime KServe ships for it (kubealign.serving.runtimes: one row
per `serve.runtime`; ../shared/k8s-schemas/kserve-v0.20.0), the storage URI of the
registered HF directory (kubealign.serving.location) and the resources from `serve`. Cluster-local unless
`serve.public`: KServe's `networking.kserve.io/visibility: cluster-local` label. Labels and annotations name
the registered model, version, alias and the pipeline run, so `kubectl get isvc -l kubealign.io/alias=champion`
finds it and a person sees what answers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

from kubealign.config.serve import ServeConfig
from kubealign.serving.endpoints import CANARY, ROLE_LABEL, STABLE, predictor_labels
from kubealign.serving.identity import version_name
from kubealign.serving.location import Served
from kubealign.serving.runtimes import runtime

API_VERSION, KIND = "serving.kserve.io/v1beta1", "InferenceService"
PLURAL, GROUP, VERSION = "inferenceservices", "serving.kserve.io", "v1beta1"
PREFIX = "kubealign.io"


def dns_name(name: str) -> str:
    """A registered model's name as a DNS-1035 label (KServe derives hostnames from it): lower case, other
    characters as '-', starting with a letter, at most 45 characters (KServe appends -predictor-... to make
    its Services) with a hash of the original name when anything was changed or cut."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not label or not label[0].isalpha():
        label = f"m-{label}".rstrip("-")
    if label == name and len(label) <= 45:
        return label
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{label[:36].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """A label value (63 characters of [A-Za-z0-9-_.], alphanumeric at both ends); annotations keep the text."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def image(cfg: ServeConfig) -> str | None:
    """The predictor's image; None keeps the runtime's. auto: the runtime's row's CPU image without GPUs."""
    if cfg.image == "auto":
        cpu_image = runtime(cfg.runtime).cpu_image
        return cpu_image() if cpu_image and not cfg.gpus else None
    return None if cfg.image == "runtime" else cfg.image


def inference_service(
    served: Served,
    storage_uri: str,
    cfg: ServeConfig,
    namespace: str,
    accelerator: str = "nvidia.com/gpu",
    chat_template: str | None = None,
) -> dict[str, Any]:
    """chat_template: the template an OpenAI-server runtime is given (kubealign.serving.chat; None: the
    tokenizer's)."""
    row = runtime(cfg.runtime)
    amounts = {"cpu": cfg.cpu, "memory": cfg.memory, **({accelerator: str(cfg.gpus)} if cfg.gpus else {})}
    model: dict[str, Any] = {
        "modelFormat": {"name": row.model_format},
        "runtime": row.kserve_runtime,
        "storageUri": storage_uri,
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
    }
    chosen = image(cfg)
    if chosen:
        model["image"] = chosen
    args = [f"--max-model-len={cfg.max_model_len}"] if cfg.max_model_len else []
    name = cfg.name or dns_name(served.name)
    if row.openai_server:
        # The runtime's command is vLLM's OpenAI server (runtime-kserve-vllmserver.yaml); these follow its args.
        # Its --served-model-name={{.Name}} (the InferenceService's name) again, and the version's model URI
        # (the last --served-model-name is vLLM's): /v1/models then says which version this predictor serves,
        # which the online judge checks (kubealign.serving.identity).
        args += ["--served-model-name", name, version_name(served.name, served.version)]
        if not cfg.gpus:  # as `kubealign serve` runs it: served = evaluated in fp32
            args.append(f"--dtype={cfg.cpu_dtype}")
            model["env"] = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(cfg.kv_cache_gib)}]
        if chat_template:
            args.append(f"--chat-template={chat_template}")
        if cfg.tool_call_parser:  # the calls the policy learned to write (docs/tools.md), as vLLM's tool_calls
            args += ["--enable-auto-tool-choice", f"--tool-call-parser={cfg.tool_call_parser}"]
    if args:
        model["args"] = args
    # on the predictor's pods, for the judge to ask this model alone (kubealign.serving.endpoints)
    predictor: dict[str, Any] = {"labels": predictor_labels(name, STABLE, label_value(served.version)), "model": model}
    if cfg.service_account:
        predictor["serviceAccountName"] = cfg.service_account
    labels = {
        "app.kubernetes.io/managed-by": "kubealign",
        f"{PREFIX}/registered-model": label_value(served.name),
        f"{PREFIX}/model-version": label_value(served.version),
        f"{PREFIX}/alias": label_value(served.alias),
    }
    if not cfg.public:
        labels["networking.kserve.io/visibility"] = "cluster-local"
    annotations = {
        f"{PREFIX}/registered-model": served.name,
        f"{PREFIX}/model-version": served.version,
        f"{PREFIX}/alias": served.alias,
        f"{PREFIX}/model-uri": f"models:/{served.name}/{served.version}",
        f"{PREFIX}/registry-run": served.run_id,
        f"{PREFIX}/storage-uri": storage_uri,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"predictor": predictor},
    }


def with_pipeline_run(manifest: dict[str, Any], run_id: str | None) -> dict[str, Any]:
    """The manifest annotated with the KFP run that deployed it (the serve task knows it; the CLI does not)."""
    if run_id:
        manifest["metadata"]["annotations"][f"{PREFIX}/pipeline-run"] = run_id
    return manifest


def with_digest(body: dict[str, Any], model_sha256: str, files: dict[str, str]) -> dict[str, Any]:
    """The manifest annotated with the version's digests (kubealign.provenance): model-sha256 over all files and
    files-sha256, {file: sha256} as JSON, for a storage initializer or runtime that checks what it downloaded.
    KServe itself checks none: its storage initializer copies s3://, gs://, pvc:// as they are."""
    annotations = body["metadata"]["annotations"]
    annotations[f"{PREFIX}/model-sha256"] = model_sha256
    annotations[f"{PREFIX}/files-sha256"] = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return body


def with_canary(body: dict[str, Any], canary: dict[str, Any], percent: int) -> dict[str, Any]:
    """`body` (the stable alias's InferenceService) with `canary`'s predictor (another alias's, as
    inference_service makes it) taking `percent` of the traffic. KServe v0.20's `spec.canary`, a list of
    predictors with their traffic shares; not `predictor.canaryTrafficPercent`, the older single-canary field
    that only the Serverless (Knative) mode honours (../shared/k8s-schemas/kserve-v0.20.0/README.md).
    Annotations name the canary's alias, version and files, as the stable predictor's are named."""
    theirs = canary["metadata"]["annotations"]
    predictor = copy.deepcopy(canary["spec"]["predictor"])
    # v0.20's canary predictor takes a full Container as its model: it needs the name, the one KServe's runtimes
    # give the container it merges the model into (runtime-kserve-*.yaml)
    predictor["model"] = {"name": "kserve-container", **predictor["model"]}
    predictor["labels"][ROLE_LABEL] = CANARY
    body["spec"]["canary"] = [{"predictor": predictor, "trafficPercent": percent}]
    ours = body["metadata"]["annotations"]
    for key in ("alias", "model-version", "model-uri", "storage-uri"):
        ours[f"{PREFIX}/canary-{key}"] = theirs[f"{PREFIX}/{key}"]
    if f"{PREFIX}/model-sha256" in theirs:
        ours[f"{PREFIX}/canary-model-sha256"] = theirs[f"{PREFIX}/model-sha256"]
    ours[f"{PREFIX}/canary-traffic-percent"] = str(percent)
    body["metadata"]["labels"][f"{PREFIX}/canary-alias"] = theirs[f"{PREFIX}/alias"]
    return body
