"""The rollout-path preflight: every combination gets a path and a reason, never a crash; whether DeepSpeed
injects is asked of DeepSpeed, over the model's own layer classes."""

from __future__ import annotations

import inspect

import pytest

from kubealign.config.schema import HybridEngineConfig
from kubealign.rl.preflight import decide, inference_kernels, would_inject

HE = HybridEngineConfig()
OPT = ["OPTDecoderLayer"]
LLAMA = ["LlamaDecoderLayer"]
NO_KERNELS = (False, "DeepSpeed implements no inference kernels on cpu")
KERNELS = (True, "")


@pytest.mark.parametrize(
    ("hybrid", "zero", "model_type", "heads", "kv", "cuda", "tf", "injected", "kernels", "path", "note"),
    [
        (
            HE,
            0,
            "opt",
            4,
            None,
            False,
            "5.23.0",
            [],
            NO_KERNELS,
            "he-plain",
            "injects no kernels into opt under transformers 5.23.0: hybrid engine without",
        ),
        # transformers 5.24: DeepSpeed injects into OPT again, and CPU has no kernels: plain engine, not a crash
        (
            HE,
            0,
            "opt",
            4,
            None,
            False,
            "5.24.0",
            OPT,
            NO_KERNELS,
            "engine",
            "would inject its inference kernels into OPTDecoderLayer under transformers 5.24.0, but DeepSpeed implements no inference kernels on cpu",
        ),
        (HE, 3, "llama", 4, 4, False, "5.23.0", LLAMA, NO_KERNELS, "engine", "into LlamaDecoderLayer"),
        (HE, 0, "qwen2", 4, 4, False, "5.23.0", [], NO_KERNELS, "engine", "measured on CPU only for opt"),
        (
            HE,
            3,
            "opt",
            32,
            None,
            True,
            "4.46.3",
            OPT,
            KERNELS,
            "he-injected",
            "kernel-injected hybrid engine for opt (OPTDecoderLayer)",
        ),
        (HE, 3, "opt", 32, None, True, "4.46.3", OPT, (False, "cannot be built"), "engine", "but cannot be built"),
        (HE, 3, "llama", 32, 32, True, "4.48.2", LLAMA, KERNELS, "he-injected", "kernel-injected"),
        (HE, 3, "llama", 32, 8, True, "4.48.2", LLAMA, KERNELS, "engine", "does not fit LLaMA with grouped"),
        (
            HE,
            3,
            "qwen2",
            16,
            16,
            True,
            "4.48.2",
            [],
            KERNELS,
            "engine",
            "injects no kernels into qwen2 under transformers 4.48.2 (nothing to inject)",
        ),
        (HE, 3, "opt", 32, None, True, "5.23.0", [], KERNELS, "engine", "nothing to inject"),
        (
            HE,
            3,
            "llama",
            32,
            32,
            True,
            "5.23.0",
            LLAMA,
            KERNELS,
            "engine",
            "newer than the hybrid engine's injected kernels",
        ),
        (
            HybridEngineConfig(enabled=False),
            0,
            "opt",
            4,
            None,
            True,
            "4.46.0",
            OPT,
            KERNELS,
            "engine",
            "enabled is false",
        ),
    ],
)
def test_paths(hybrid, zero, model_type, heads, kv, cuda, tf, injected, kernels, path, note):
    result = decide(hybrid, zero, model_type, heads, kv, cuda, tf, injected, kernels)
    assert result.path == path
    assert any(note in n for n in result.notes), result.notes
    assert (result.hybrid_engine is None) == (path == "engine")


def test_tensor_parallel_needs_zero3_and_cuda():
    tp = HybridEngineConfig(inference_tp_size=4)
    result = decide(tp, 2, "opt", 32, None, True, "4.46.3", OPT, KERNELS)
    assert result.hybrid_engine["inference_tp_size"] == 1
    assert "needs the actor at ZeRO-3" in result.notes[0]
    assert decide(tp, 3, "opt", 32, None, True, "4.46.3", OPT, KERNELS).hybrid_engine["inference_tp_size"] == 4
    assert "needs CUDA" in decide(tp, 3, "opt", 4, None, False, "5.0", [], NO_KERNELS).notes[0]


@pytest.fixture(scope="module")
def tiny_models():
    from transformers import AutoModelForCausalLM

    from kubealign.models import tiny

    tokenizer = tiny.train_tokenizer(0)
    return {arch: AutoModelForCausalLM.from_config(tiny.model_config(arch, tokenizer)) for arch in tiny.ARCHS}


def test_would_inject_asks_deepspeed_of_the_layer_signature(tiny_models, monkeypatch):
    """DeepSpeed 0.19.8 keeps OPT layers whose forward takes past_key_values (transformers 5.0-5.23) on
    native generation and injects into those that do not: transformers 5.24's rename to `cache` is
    replayed here on the installed OPTDecoderLayer, and the answer follows it. LLaMA is always injected."""
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    params = inspect.signature(OPTDecoderLayer.forward).parameters
    legacy = "past_key_values" not in params and "cache_position" not in params  # transformers <= 4.x or >= 5.24
    assert would_inject(tiny_models["opt"]) == (OPT if legacy else [])
    assert would_inject(tiny_models["llama"]) == LLAMA

    def renamed(self, hidden_states, attention_mask=None, cache=None, use_cache=False, position_ids=None, **kwargs):
        raise AssertionError("never called: only the signature is read")

    monkeypatch.setattr(OPTDecoderLayer, "forward", renamed)
    assert would_inject(tiny_models["opt"]) == OPT


def test_this_cpu_has_no_inference_kernels():
    available, why = inference_kernels()
    assert not available
    assert why == "DeepSpeed implements no inference kernels on cpu"
