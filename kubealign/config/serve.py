"""The `serve` section: the registry's alias as a KServe InferenceService."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubealign.config.base import Section

DNS_LABEL = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"


class ServeConfig(Section):
    """What serves the model an alias names. Read by `kubealign serve --manifest` and, with `enabled`, by the
    DAG's `serve` task after promote (it applies the InferenceService when promote moved the alias)."""

    enabled: bool = Field(False, description="Add the `serve` task after promote (needs KServe in the cluster).")
    alias: str = Field("champion", min_length=1, description="The registry alias that is served.")
    name: str | None = Field(
        None, pattern=DNS_LABEL, description="InferenceService name; None = the registered model's name, made DNS-safe."
    )
    namespace: str | None = Field(
        None, pattern=DNS_LABEL, description="Namespace of the InferenceService; None = the pipeline pod's own."
    )
    runtime: Literal["huggingface", "vllm"] = Field(
        "huggingface",
        description="KServe runtime: huggingface (kserve-huggingfaceserver: vLLM on GPU, transformers otherwise) "
        "or vllm (kserve-vllmserver, vLLM's OpenAI server).",
    )
    gpus: int = Field(1, ge=0, description="GPUs of the predictor (kubernetes.accelerator_type); 0 = CPU.")
    cpu: str = Field("4", min_length=1, description="CPU request and limit of the predictor (Kubernetes quantity).")
    memory: str = Field("16Gi", min_length=1, description="Memory request and limit of the predictor.")
    max_model_len: int | None = Field(None, ge=16, description="vLLM's --max-model-len; None = the model's own.")
    tool_call_parser: str | None = Field(
        None,
        min_length=1,
        description="vLLM's --tool-call-parser, with --enable-auto-tool-choice, for an OpenAI-server runtime: "
        "'hermes' reads the tools section's <tool_call> markup (docs/tools.md). Chat completions then take "
        "`tools` where the chat template renders them; None: no tool calling.",
    )
    artifacts_destination: str | None = Field(
        None,
        pattern=r"^(s3|gs|pvc)://\S+$",
        description="The MLflow server's --artifacts-destination (s3://BUCKET[/PATH] or pvc://CLAIM/PATH): where "
        "an `mlflow-artifacts:` URI's files are, which KServe's storage initializer can read. Needed with a server "
        "that serves artifacts (the chart's).",
    )
    service_account: str | None = Field(
        None, pattern=DNS_LABEL, description="Predictor's ServiceAccount (KServe reads S3 credentials from it)."
    )
    public: bool = Field(False, description="Expose outside the cluster; False = cluster-local only.")
    ready_timeout_s: float = Field(1800, gt=0, description="How long the serve task waits for Ready.")
    image: str = Field(
        "auto",
        min_length=1,
        description="The predictor's image: auto = kubealign's serve image (images/serve: vLLM's CPU build) for the "
        "vllm runtime without GPUs, the runtime's own otherwise; runtime = always the runtime's; else an image.",
    )
    cpu_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32",
        description="vLLM's dtype on CPU (`kubealign serve`, and a vllm predictor without GPUs): fp32 makes greedy "
        "output equal transformers'.",
    )
    kv_cache_gib: int = Field(
        1, ge=1, description="vLLM's CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE), here and in a CPU vllm predictor."
    )
    start_timeout_s: float = Field(900, gt=0, description="`kubealign serve`: how long vLLM may take to answer.")
