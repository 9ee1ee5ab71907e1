"""The KServe serving runtimes `serve.runtime` can name: one row each (docs/serving.md, "Add a runtime").

A row says what the InferenceService's predictor names (KServe's model format and the ClusterServingRuntime it
ships for it, ../shared/k8s-schemas/kserve-v0.20.0), whether the runtime is vLLM's OpenAI server (it is then
given the served model names the online judge checks, the CPU dtype and KV cache, and the chat template), and
the image a CPU predictor gets when `serve.image` is auto. Pure: kubealign.serving.manifest reads the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kubealign import images


@dataclass(frozen=True)
class Runtime:
    model_format: str  # the predictor's modelFormat.name
    kserve_runtime: str  # the ClusterServingRuntime KServe ships for that format
    openai_server: bool  # vLLM's OpenAI server: --served-model-name, --dtype on CPU, --chat-template
    cpu_image: Callable[[], str] | None  # serve.image auto without GPUs; None keeps the runtime's own image


RUNTIMES: dict[str, Runtime] = {
    # KServe's huggingfaceserver runs vLLM on a GPU and transformers otherwise, with its own image
    "huggingface": Runtime("huggingface", "kserve-huggingfaceserver", openai_server=False, cpu_image=None),
    # KServe's own CPU rewrite of this runtime's image (vllm/vllm-openai-cpu) is not one the project builds
    # and checks: a CPU predictor gets kubealign's serve image (images/serve, vLLM's CPU build)
    "vllm": Runtime("vLLM", "kserve-vllmserver", openai_server=True, cpu_image=images.serve_image),
}


def runtime(name: str) -> Runtime:
    """The row of `serve.runtime` (the config's Literal lists the same names: tests/serving/test_serving.py
    checks that they agree)."""
    return RUNTIMES[name]
