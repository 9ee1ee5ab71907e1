"""The rollout-path preflight: every combination gets a path and a reason, never a crash."""

from __future__ import annotations

import pytest

from kubealign.config.schema import HybridEngineConfig
from kubealign.rl.preflight import decide

HE = HybridEngineConfig()


@pytest.mark.parametrize(
    ("hybrid", "zero", "model_type", "heads", "kv", "cuda", "tf", "path", "note"),
    [
        (HE, 0, "opt", 4, None, False, "5.23.0", "he-plain", "no kernel injection on CPU"),
        (HE, 3, "llama", 4, 4, False, "5.23.0", "engine", "cannot initialize llama on CPU"),
        (HE, 3, "opt", 32, None, True, "4.46.3", "he-injected", "kernel-injected hybrid engine for opt"),
        (HE, 3, "llama", 32, 32, True, "4.48.2", "he-injected", "kernel-injected"),
        (HE, 3, "llama", 32, 8, True, "4.48.2", "engine", "no kernel-injection policy for LLaMA with grouped"),
        (HE, 3, "qwen2", 16, 16, True, "4.48.2", "engine", "no kernel-injection policy for qwen2"),
        (HE, 3, "opt", 32, None, True, "5.23.0", "engine", "newer than the hybrid engine's kernels"),
        (HybridEngineConfig(enabled=False), 0, "opt", 4, None, True, "4.46.0", "engine", "enabled is false"),
    ],
)
def test_paths(hybrid, zero, model_type, heads, kv, cuda, tf, path, note):
    result = decide(hybrid, zero, model_type, heads, kv, cuda, tf)
    assert result.path == path
    assert any(note in n for n in result.notes), result.notes
    assert (result.hybrid_engine is None) == (path == "engine")


def test_tensor_parallel_needs_zero3_and_cuda():
    tp = HybridEngineConfig(inference_tp_size=4)
    result = decide(tp, 2, "opt", 32, None, True, "4.46.3")
    assert result.hybrid_engine["inference_tp_size"] == 1
    assert "needs the actor at ZeRO-3" in result.notes[0]
    assert decide(tp, 3, "opt", 32, None, True, "4.46.3").hybrid_engine["inference_tp_size"] == 4
    assert "needs CUDA" in decide(tp, 3, "opt", 4, None, False, "5.0").notes[0]
