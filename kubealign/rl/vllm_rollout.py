"""A vLLM engine colocated in the trainer's process as the actor's rollout engine, with the shape
of DeepSpeed's rollout API (deepspeed.runtime.rollout): generate(RolloutRequest, SamplingConfig) returns a
RolloutBatch laid out exactly as HybridEngineRollout's, and the log-prob vLLM sampled each response token with
is kept in `last_logprobs` for the rollout-trainer mismatch correction (kubealign.rl.correction).

As in TRL's colocate mode and veRL's hybrid engine: the engine runs in this process (vLLM's v1 engine core
in-process, no worker processes), so `load_weights` copies the actor's current weights into vLLM's model after
each update without a restart, and `sleep` / `wake` release the engine's memory between rollouts where vLLM
supports it (CUDA, ROCm, XPU; not on CPU, where they do nothing). Deviations from vLLM's defaults, each for
the trainer: sampling settings come from the SamplingConfig alone (generation_config="vllm": nothing from the
checkpoint's generation_config.json, as rollout.only_settings does for HF generate); log-probs are taken after
temperature, top-k and top-p (logprobs_mode="processed_logprobs", the distribution the token was drawn from);
the engine's start-up reseeds nothing of the trainer's RNG and leaves torch.set_num_threads working.

Needs vLLM in the trainer's environment: requirements/lock-vllm.txt (`make .venv-vllm/.installed`).
Shapes: B prompts, n samples each, N = B * n rows, P prompt columns (left-padded), R = the longest response.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from kubealign.rl.rollout import merged_lora  # the LoRA merge the generate-loop engines use

# PEFT's names for what is not a weight of the base model: adapters (merged before loading) and the frozen
# copies modules_to_save keeps.
_ADAPTER_MARKS = ("lora_", "original_module")


class VLLMSettings(Protocol):
    """The ppo.rollout settings this engine reads (config.schema's section, or any object with these fields)."""

    vllm_memory: float  # vLLM's gpu_memory_utilization: the share of device memory vLLM may take
    vllm_sleep: bool  # release vLLM's memory between rollouts (where vLLM supports sleep mode)
    vllm_kv_cache_gib: float  # CPU only: GiB of KV cache (vLLM's default wants most of the RAM)


def _prepare_environment(settings: VLLMSettings) -> None:
    """Environment vLLM reads when it is imported or builds its engine; a user's own setting wins, except the
    in-process switch, without which load_weights could not reach the model (it would live in a worker
    process; on CPU vLLM would also switch the executor to multiprocessing)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM reads it as whole GiB (int()); round up so that a fraction never means no cache at all.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(settings.vllm_kv_cache_gib))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's logger is configured once, when vllm is first imported: quiet it here too in case it already was.
    if os.environ["VLLM_LOGGING_LEVEL"] == "WARNING":
        logging.getLogger("vllm").setLevel(logging.WARNING)


def _joins_process_group() -> bool:
    """Whether torch.distributed is initialized (the trainer's group, or an earlier engine's in this process):
    then vLLM's external launcher joins it, and reads the rank from the environment torchrun sets; a process
    group started otherwise (one process, deepspeed.init_distributed without a launcher) gets it set here."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    return True


@contextlib.contextmanager
def _default_group_kept() -> Iterator[None]:
    """torch.distributed.destroy_process_group destroys the groups it is given and ignores calls for the
    default group (vLLM's teardown asks for both) for the duration."""
    destroy = torch.distributed.destroy_process_group

    def subgroups_only(group: Any = None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = subgroups_only
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


@contextlib.contextmanager
def _trainer_state_kept() -> Iterator[None]:
    """vLLM's worker seeds torch's global RNG with its own seed and, on CPU, replaces torch.set_num_threads
    with a no-op (it binds its OpenMP threads once): both are the trainer's, so both are put back."""
    set_num_threads = torch.set_num_threads
    try:
        with torch.random.fork_rng():
            yield
    finally:
        torch.set_num_threads = set_num_threads


# kubealign's precisions (ppo.dtype) in vLLM's words; vLLM's own names pass unchanged
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLLMRollout:
    """The actor's rollout engine: vLLM in this process. load_weights after every update, before generate."""

    def __init__(self, model_dir: str, tokenizer: Any, dtype: str, seed: int, settings: VLLMSettings):
        _prepare_environment(settings)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tokenizer, self.seed, self.calls = tokenizer, seed, 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.sleep_mode = bool(settings.vllm_sleep) and current_platform.is_sleep_mode_available()
        self.asleep = False
        self.last_logprobs: torch.Tensor | None = None
        on_cpu = current_platform.is_cpu()
        distributed = _joins_process_group()
        with _trainer_state_kept():
            self.llm = LLM(
                model=str(model_dir),
                dtype=VLLM_DTYPES.get(dtype, dtype),
                seed=seed,
                gpu_memory_utilization=settings.vllm_memory,
                enable_sleep_mode=self.sleep_mode,
                # CPU: no graphs to capture, and compiling the model takes minutes of start-up on few cores.
                enforce_eager=on_cpu,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                # With the trainer's process group (DeepSpeed's, torchrun's) each rank runs its own engine on its
                # own rows inside that group, as TRL's colocate mode does; without one vLLM makes its own.
                distributed_executor_backend="external_launcher" if distributed else None,
            )

    # --- generation --------------------------------------------------------------------------------------

    def _params(self, sampling: Any, stop_text: str | None, seed: int) -> Any:
        """vLLM's SamplingParams of one prompt: DeepSpeed's SamplingConfig (temperature <= 0: greedy; top_k
        <= 0: off, which vLLM spells 0), every other processor off, the sampled token's log-prob kept."""
        from vllm import SamplingParams

        greedy = sampling.temperature <= 0.0
        return SamplingParams(
            n=sampling.n_samples_per_prompt,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else max(sampling.top_k, 0),
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=[self.eos_id],
            stop=[stop_text] if stop_text else None,
            include_stop_str_in_output=bool(stop_text),
            # Stop strings are matched on the detokenized text; without one the text is not needed.
            detokenize=bool(stop_text),
        )

    @torch.no_grad()
    def generate(self, request: Any, sampling: Any, stop_text: str | None = None) -> Any:
        """Sample n responses per prompt; a RolloutBatch laid out as HybridEngineRollout's (prompt-major rows).

        stop_text: a string that also ends a response (a tool call's closing tag), kept in the response.
        Seeded by (seed, number of this call, prompt): the same engine seed gives the same rollouts."""
        from vllm.inputs import TokensPrompt

        self.wake()
        prompts = [
            TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist())
            for ids, mask in zip(request.prompt_ids.cpu(), request.prompt_attention_mask.cpu(), strict=True)
        ]
        n = sampling.n_samples_per_prompt
        # vLLM gives a request's i-th sample the seed + i: prompts are spaced n apart, calls far apart.
        first = (self.seed * 1_000_003 + self.calls * 65_537) % (2**62)
        params = [self._params(sampling, stop_text, first + i * n) for i in range(len(prompts))]
        self.calls += 1
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = [sample for out in outputs for sample in sorted(out.outputs, key=lambda s: s.index)]
        responses, logprobs = zip(*(self._response(sample) for sample in samples), strict=True)
        return self._batch(request, n, list(responses), list(logprobs))

    def _response(self, sample: Any) -> tuple[list[int], list[float]]:
        """A sample's tokens up to and including its first EOS, and the log-prob each was sampled with."""
        tokens = list(sample.token_ids)
        if self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id) + 1]
        # logprobs=0: one entry per token, the sampled token's (its id is the key).
        values = [step[token].logprob for token, step in zip(tokens, sample.logprobs or [], strict=False)]
        if len(values) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(values)} log-probs for {len(tokens)} tokens")
        return tokens, values

    def _batch(self, request: Any, n: int, responses: list[list[int]], logprobs: list[list[float]]) -> Any:
        """input_ids [N, P + R]: the prompt columns as given, each response right-padded; last_logprobs [N, P + R
        - 1]: at action t the log-prob of token t + 1 (SampledLogprobs.actions' alignment), 0 elsewhere."""
        from deepspeed.runtime.rollout import RolloutBatch

        device = request.prompt_ids.device
        prompt_ids = request.prompt_ids.repeat_interleave(n, 0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, 0)
        rows, width = prompt_ids.shape[0], prompt_ids.shape[1]
        longest = max(len(r) for r in responses)
        ids = torch.full((rows, longest), self.pad_id, dtype=prompt_ids.dtype)
        mask = torch.zeros((rows, longest), dtype=prompt_mask.dtype)
        sampled = torch.zeros((rows, width + longest - 1), dtype=torch.float32)
        for row, (tokens, values) in enumerate(zip(responses, logprobs, strict=True)):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=ids.dtype)
            mask[row, : len(tokens)] = 1
            sampled[row, width - 1 : width - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
        self.last_logprobs = sampled.to(device)
        return RolloutBatch(
            input_ids=torch.cat([prompt_ids, ids.to(device)], 1),
            attention_mask=torch.cat([prompt_mask, mask.to(device)], 1),
            response_start_idx=torch.full((rows,), width, dtype=torch.long, device=device),
        )

    # --- weights -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, module: Any) -> None:
        """Copy `module`'s current weights into the engine in place (no restart), then drop vLLM's prefix
        cache, whose KV entries the old weights computed. module: the actor's HF model, or a PEFT model (its
        LoRA adapters merged for the copy, unmerged after). Under ZeRO-3 the parameters are gathered one
        submodule at a time as vLLM reads them, never the whole model (except to merge LoRA, which needs every
        weight at once, as rollout.merged_lora does).

        Through vLLM's own in-place reload (the worker's reload_weights): after loading, vLLM's CPU backend
        repacks each linear layer's weight into its kernel's layout, and a plain model.load_weights into that
        layout fails; the reload restores each layer's checkpoint layout, loads, and repacks the layer once all
        its weights have arrived. A layer that shares its weight with another (a tied LM head) loads nothing
        itself, so it is repacked here (_repack_tied)."""
        self.wake()
        with merged_lora(module):
            # In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the generator is handed over, not pickled.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _weights(module)})
        self.llm.apply_model(_repack_tied)
        self.llm.reset_prefix_cache()

    # --- memory between rollouts -------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the engine's memory until the next wake/generate/load_weights (vLLM's sleep level 1: the
        weights move to host memory, the KV cache is dropped, so waking is correct even without a new
        load_weights). A no-op unless settings.vllm_sleep and the device supports it: on CPU vLLM has no
        sleep mode (its memory is host memory already), so the KV cache stays allocated there."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Undo sleep(); generate and load_weights call it themselves. A no-op when awake or without sleep mode."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down (its worker, KV cache and vLLM's own process groups) and keep torch.distributed's
        default group, which vLLM's teardown would destroy too: it is the trainer's (DeepSpeed caches groups
        made from it), torn down by the trainer's own shutdown. Left to interpreter exit, vLLM's teardown
        would run after the trainer's and fail on groups already gone. The ranks meet at a barrier first."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        with _default_group_kept():
            self.llm.llm_engine.engine_core.shutdown()


def _repack_tied(model: torch.nn.Module) -> int:
    """Rerun weight processing of every layer whose weight another layer shares (OPT's LM head is its token
    embedding); returns how many. vLLM's CPU backend computes with a packed copy of each weight made when the
    layer is processed, and the reload processes only layers that received weights: the tied alias receives
    none (vLLM skips it), so its packed copy kept the old weights while the embedding took the new ones."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for layer in model.modules():
        for param in layer.parameters(recurse=False):
            owners.setdefault(id(param), []).append(layer)
    repacked = 0
    for layers in owners.values():
        for layer in layers if len(layers) > 1 else []:
            method = getattr(layer, "quant_method", None)
            if hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(layer)
                repacked += 1
    return repacked


def vllm_name(name: str) -> str:
    """The checkpoint name vLLM's load_weights expects for a parameter of the trainer's model: PEFT's wrapper
    prefix and LoRA layer infix removed, modules_to_save's trained copy under the module's own name."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace(".modules_to_save.default", "")


def _weights(module: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(vLLM's name, tensor) of every weight of the base model, one submodule's parameters gathered at a time.
    A tied weight (OPT's lm_head is its embedding) goes once, under its first name: vLLM skips the alias."""
    import deepspeed

    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        weights = []
        for name, param in sub.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if id(param) in seen or any(mark in full for mark in _ADAPTER_MARKS):
                continue
            seen.add(id(param))
            weights.append((vllm_name(full), param))
        if not weights:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in weights]):
            for name, param in weights:
                # vLLM buffers a layer's tensors until the layer is complete: a ZeRO-3 parameter's gathered
                # storage is released when this block ends, so that one goes as a copy.
                yield name, (param.data.clone() if hasattr(param, "ds_id") else param.data)
