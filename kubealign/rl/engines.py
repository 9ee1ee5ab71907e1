"""The rollout engines (ppo.rollout.engine): which one generates, and what each changes about generation.

* hf — transformers' generate loop, through DeepSpeed's rollout API (the hybrid engine's path, or the module's
  generate on a plain engine): what every route used before there was a choice.
* compiled — the same loop, the same logits processors and stopping criteria, with a static KV cache and the
  model's forward compiled by torch.compile (mode reduce-overhead on a GPU: CUDA graphs, so a decode step's
  kernel launches are replayed as one; DeepSpeed PR #8271 measured OPT-1.3B at ~2.8 ms a step that way against
  5-10 ms eager). The sampling and the recorded log-probs are generate's own, so nothing else changes.
* vllm — a vLLM engine in the trainer's process (kubealign.rl.vllm_rollout): the actor's weights loaded into it
  before a rollout whenever they changed, its own sampler and its own log-probs (the mismatch correction's
  denominator), asleep during the update where the device has vLLM's sleep mode.

choose() is pure: the stage asks it with what it knows of the device, the model and the environment, and logs
its one-line note. An engine that cannot run here is a note and a fallback, never a crash.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any, NamedTuple

# The model types each engine's exactness tests run on (tests/rl/test_engines.py, tests/rl/test_vllm_rollout.py:
# greedy tokens equal to HF eager's after updates, full model and LoRA, fp32 on CPU).
CHECKED = {"compiled": {"opt", "llama"}, "vllm": {"opt", "llama"}}
EXPLAINED = {
    "compiled": "ppo.rollout.engine compiled: generate's loop with a static KV cache and a compiled forward",
    "vllm": "ppo.rollout.engine vllm: vLLM in the trainer's process, the actor's weights loaded before each rollout",
}


class Choice(NamedTuple):
    engine: str  # hf | compiled | vllm
    note: str  # why, in one line


def vllm_available() -> bool:
    """Whether vLLM can be imported here (the vLLM trainer environment: requirements/lock-vllm.txt)."""
    return importlib.util.find_spec("vllm") is not None


def choose(asked: str, cuda: bool, world: int, actor_zero_stage: int, model_type: str, has_vllm: bool) -> Choice:
    """The engine for ppo.rollout.engine ASKED on this device (cuda), WORLD ranks, the actor's ZeRO stage, its
    model_type, and whether vLLM is importable."""
    sharded = world > 1 and actor_zero_stage == 3

    def compiled_blocker() -> str:
        if sharded:
            return "the actor's weights are sharded over ranks (ZeRO-3 gathers them inside each forward)"
        if model_type not in CHECKED["compiled"]:
            return f"its exactness is checked for {', '.join(sorted(CHECKED['compiled']))} only, not {model_type}"
        return ""

    def vllm_blocker() -> str:
        if not has_vllm:
            return "vLLM is not installed in this environment (make .venv-vllm/.installed)"
        if model_type not in CHECKED["vllm"]:
            return f"its exactness is checked for {', '.join(sorted(CHECKED['vllm']))} only, not {model_type}"
        return ""

    if asked == "hf":
        return Choice("hf", "ppo.rollout.engine hf: transformers' generate loop")
    if asked in ("compiled", "vllm"):
        why = compiled_blocker() if asked == "compiled" else vllm_blocker()
        return Choice("hf", f"ppo.rollout.engine {asked}, but {why}: hf") if why else Choice(asked, EXPLAINED[asked])
    if not cuda:
        return Choice(
            "hf",
            "ppo.rollout.engine auto on CPU: hf (compiling a shape or starting vLLM costs more than a small "
            "model's whole rollout; at OPT-125M's shape vllm generated 2.1x faster: docs/ppo.md)",
        )
    for engine, why in (("vllm", vllm_blocker()), ("compiled", compiled_blocker())):
        if not why:
            return Choice(engine, f"ppo.rollout.engine auto on a GPU: {engine}, the fastest engine that can run here")
    return Choice(
        "hf", f"ppo.rollout.engine auto on a GPU: hf (vllm: {vllm_blocker()}; compiled: {compiled_blocker()})"
    )


def compiled_settings(settings: Any, mode: str, cuda: bool) -> Any:
    """settings (a GenerationConfig) with a static KV cache and a compiled forward. transformers compiles only
    on accelerators unless told otherwise (CompileConfig's _compile_all_devices): on CPU it is told, so the
    same path runs in the tests."""
    from transformers import CompileConfig

    chosen = ("reduce-overhead" if cuda else "default") if mode == "auto" else mode
    compile_config = CompileConfig(mode=chosen)
    compile_config._compile_all_devices = True
    settings.cache_implementation = "static"
    settings.compile_config = compile_config
    return settings


@contextlib.contextmanager
def awake(models: Any) -> Iterator[None]:
    """One rollout (all its turns) with a vLLM engine awake and holding the actor's current weights, asleep
    again after it; nothing for the generate-loop engines. The weights are loaded only when the actor stepped
    since they last were (its optimizer step count), so a multi-turn rollout loads them once."""
    engine = models.rollout
    if not hasattr(engine, "load_weights"):
        yield
        return
    engine.wake()
    step = int(getattr(models.actor, "global_steps", 0))
    if getattr(engine, "weights_step", None) != step:
        engine.load_weights(models.actor.module)
        engine.weights_step = step
    try:
        yield
    finally:
        engine.sleep()


def close(models: Any) -> None:
    """Shut down an engine that holds resources of its own (vLLM: its worker, KV cache and process groups)
    before the trainer's own teardown; nothing for the generate-loop engines."""
    shut = getattr(models.rollout, "close", None)
    if shut is not None:
        shut()
