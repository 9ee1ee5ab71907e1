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
        (HE, 3, "opt", 4, None, False, "5.23.0", [], NO_KERNELS, "he-plain", "without injection"),  # CPU: any ZeRO
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
            "injects no kernels into qwen2 under transformers 4.48.2 (nothing to inject; without injection measured on CUDA only for opt)",
        ),
        # CUDA, nothing injected: the hybrid engine without injection where it was measured on a GPU (OPT at
        # ZeRO 2: docs/gpu.md), at ZeRO 0 to 2; ZeRO 3 (not measured there) keeps the plain engine
        (HE, 3, "opt", 32, None, True, "5.23.0", [], KERNELS, "engine", "measured on CUDA at actor ZeRO <= 2 only"),
        (HE, 2, "opt", 32, None, True, "5.17.0", [], KERNELS, "he-plain", "hybrid engine without injection"),
        (HE, 0, "opt", 32, None, True, "5.23.0", [], KERNELS, "he-plain", "hybrid engine without injection"),
        (HE, 2, "qwen2", 16, 16, True, "5.17.0", [], KERNELS, "engine", "measured on CUDA only for opt"),
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


def test_the_hybrid_engine_block_carries_every_setting():
    from kubealign.rl.preflight import hybrid_block

    hybrid = HybridEngineConfig(
        max_out_tokens=333,
        inference_tp_size=2,
        release_inference_cache=True,
        pin_parameters=False,
        tp_gather_partition_size=5,
    )
    assert hybrid_block(hybrid) == {
        "enabled": True,
        "max_out_tokens": 333,
        "inference_tp_size": 2,
        "release_inference_cache": True,
        "pin_parameters": False,
        "tp_gather_partition_size": 5,
    }


@pytest.mark.parametrize(
    ("tp", "zero", "cuda", "notes"),
    [
        (1, 0, False, []),  # nothing to adjust
        (2, 2, True, ["ppo.hybrid_engine.inference_tp_size 2 needs the actor at ZeRO-3: using 1"]),
        (2, 3, False, ["ppo.hybrid_engine.inference_tp_size 2 needs CUDA: using 1"]),
    ],
)
def test_the_exact_notes(tp, zero, cuda, notes):
    kernels = KERNELS if cuda else NO_KERNELS
    got = decide(HybridEngineConfig(inference_tp_size=tp), zero, "opt", 4, None, cuda, "4.46.0", OPT, kernels)
    assert got.notes[:-1] == notes
    disabled = decide(HybridEngineConfig(enabled=False), 0, "opt", 4, None, True, "4.46.0", OPT, KERNELS)
    assert disabled.notes == ["ppo.hybrid_engine.enabled is false: plain DeepSpeed engine"]


def test_injection_into_several_layers_and_policies_that_do_not_fit():
    two = decide(HE, 3, "opt", 32, None, True, "4.46.3", ["OPTDecoderLayer", "OPTAttention"], KERNELS)
    assert two.notes == ["kernel-injected hybrid engine for opt (OPTDecoderLayer, OPTAttention)"]
    gpt2 = decide(HE, 3, "gpt2", 12, None, True, "4.46.3", ["GPT2Block"], KERNELS)
    assert (gpt2.path, gpt2.notes) == (
        "engine",
        ["DeepSpeed's kernel-injection policy does not fit gpt2: plain engine"],
    )
    edge = decide(HE, 3, "opt", 32, None, True, "4.49.0", OPT, KERNELS)  # the first release past 4.48.x
    assert edge.path == "engine" and edge.notes[-1].startswith("transformers 4.49.0 is newer than")
    assert decide(HE, 3, "opt", 32, None, True, "4.48.9", OPT, KERNELS).path == "he-injected"


class FakeBuilder:
    def __init__(self, compatible: bool):
        self.compatible = compatible

    def is_compatible(self, verbose: bool = True) -> bool:
        assert verbose is False  # no build log in the stage's output
        return self.compatible


class FakeAccelerator:
    def __init__(self, builder):
        self.builder, self.asked = builder, []

    def device_name(self) -> str:
        return "cuda"

    def create_op_builder(self, name: str):
        self.asked.append(name)
        return self.builder


@pytest.mark.parametrize(
    ("builder", "expected"),
    [
        (FakeBuilder(True), (True, "")),
        (FakeBuilder(False), (False, "DeepSpeed's inference kernels cannot be built or loaded on this cuda setup")),
        (None, (False, "DeepSpeed implements no inference kernels on cuda")),
    ],
)
def test_inference_kernels_asks_the_accelerator_for_its_inference_builder(monkeypatch, builder, expected):
    import deepspeed.accelerator

    fake = FakeAccelerator(builder)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    assert inference_kernels() == expected
    assert fake.asked == ["InferenceBuilder"]
