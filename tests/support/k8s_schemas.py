"""Validate Kubeflow Trainer and KServe resources against the CRD schemas in ../shared/k8s-schemas.

The API server prunes unknown fields of a structural schema silently, so a typo in a field name would
vanish on a real cluster without an error. These validators are stricter than the server: wherever a
schema lists `properties` (and does not preserve unknown fields), any other key is an error.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3] / "shared" / "k8s-schemas"
SCHEMAS = ROOT / "kubeflow-trainer-v2.3.0"
FILES = {  # kind: (schema file, version)
    "TrainJob": (SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
    "ClusterTrainingRuntime": (SCHEMAS / "trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1"),
    "InferenceService": (ROOT / "kserve-v0.20.0" / "serving.kserve.io_inferenceservices.yaml", "v1beta1"),
}


def _closed(schema: Any) -> Any:
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    path, wanted = FILES[kind]
    if not path.exists():
        pytest.skip(f"CRD schemas {path.parent} are absent (../shared is not beside the repo)")
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == wanted)
    schema = _closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is checked by the API server
    return jsonschema.Draft7Validator(schema)


def errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of a Trainer or KServe manifest, as 'path: message'."""
    validator = crd_validator(manifest["kind"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
