"""Rollout: the models of an RL iteration, and how the actor generates (the hybrid engine's rollout API or
the module's generate), with the sampling settings and nothing else, LoRA merged for generation, the hooks
that end a response at its first EOS and repair invalid logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kubealign.config.schema import PPOConfig
from kubealign.rl import engines
from kubealign.rl.losses import Sampling


def generation_config(sampling: Sampling, max_new_tokens: int, tokenizer: Any) -> Any:
    """A GenerationConfig that samples from exactly sampling_logits(logits, sampling): every other logits
    processor spelled out as off, since any setting left unset is filled from the model's own
    generation_config.json (transformers' default top_k is 50; a checkpoint may add a repetition penalty)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=0.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_new_tokens=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


@contextlib.contextmanager
def merged_lora(module: Any) -> Iterator[None]:
    """Merge PEFT LoRA adapters into the base weights for generation, unmerge after. The hybrid engine's
    injected kernels read the base weights only; merging keeps generation equal to the adapter model.
    Under ZeRO-3 the parameters are gathered with rank 0 as the modifier, so every rank sees the merge."""
    if not hasattr(module, "merge_adapter"):
        yield
        return
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        module.merge_adapter()
    try:
        yield
    finally:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            module.unmerge_adapter()


class ModuleRollout:
    """The rollout API's shape over module.generate, for the plain-engine path."""

    def __init__(self, engine: Any, tokenizer: Any, synced_gpus: bool):
        self.engine, self.tokenizer, self.synced_gpus = engine, tokenizer, synced_gpus

    def generate(self, request: Any, sampling: Any) -> Any:
        from deepspeed.runtime.rollout import RolloutBatch

        module = self.engine.module
        out = module.generate(
            input_ids=request.prompt_ids,
            attention_mask=request.prompt_attention_mask,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),  # 0 disables; None would mean the model's default (50)
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=sampling.n_samples_per_prompt,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            synced_gpus=self.synced_gpus,
        )
        start = torch.full((out.shape[0],), request.prompt_ids.shape[1], dtype=torch.long, device=out.device)
        return RolloutBatch(out, torch.ones_like(out), start)


def disable_dropout(model: torch.nn.Module) -> None:
    """PPO without dropout (as TRL does): the log-probs of the rollout and of the first update pass are
    then computed by the same function, so the ratio is exactly 1 before any step."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


@dataclass
class PPOModels:
    actor: Any  # DeepSpeed engine (hybrid or plain), trainable
    critic: Any  # DeepSpeed engine, trainable; None for grpo / rloo (critic-free)
    reference: Any  # frozen module or engine
    reward: Any  # a rewards.scorer.Scorer (reward model and / or functions)
    rollout: Any  # HybridEngineRollout or ModuleRollout
    tokenizer: Any
    synced_gpus: bool = False  # ranks generate in lockstep (several ranks with actor ZeRO-3)
    tools: Any = None  # a multiturn.ToolSession: rollouts in turns with tools or an environment; None: one answer
    engine: str = "hf"  # ppo.rollout.engine as chosen (rl.engines): hf | compiled | vllm


def sampling_config(cfg: PPOConfig, max_new_tokens: int | None = None, samples: int | None = None) -> Any:
    """DeepSpeed's SamplingConfig of the ppo section; a multi-turn turn sets its own length and one sample."""
    from deepspeed.runtime.rollout import SamplingConfig

    return SamplingConfig(
        max_new_tokens=cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        n_samples_per_prompt=cfg.group_size if samples is None else samples,
    )


def generate(
    models: PPOModels,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    cfg: PPOConfig,
    recorder: SampledLogprobs | None = None,
    max_new_tokens: int | None = None,
    samples: int | None = None,
    stop: Any = None,
) -> Any:
    """Sample responses with the actor in eval mode (the hybrid engine's inference kernels; the next
    log-prob pass puts it back in train mode) and its adapters merged for the duration. recorder: keeps the
    log-prob each sampled token had in the rollout (SampledLogprobs). max_new_tokens, samples: a multi-turn
    turn's (default: cfg.max_new_tokens, cfg.group_size); stop: one more stopping criterion (a turn's end)."""
    from deepspeed.runtime.rollout import RolloutRequest

    most = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
    request, sampling = RolloutRequest(prompt_ids, prompt_mask), sampling_config(cfg, most, samples)
    if models.engine == "vllm":  # its own sampler (rl.engines.awake gave it the actor's weights)
        batch = models.rollout.generate(request, sampling, stop_text=getattr(stop, "text", None))
        if recorder is not None:
            recorder.given = models.rollout.last_logprobs
        return batch
    models.actor.eval()
    settings = generation_config(Sampling.of(cfg), most, models.tokenizer)
    # min_p 0 removes nothing, yet generate() would run its softmax and vocabulary sort every step; None
    # cannot be filled in from the checkpoint here, since only_settings replaces the checkpoint's config.
    settings.min_p = None
    if models.engine == "compiled":
        settings = engines.compiled_settings(settings, cfg.rollout.compile_mode, prompt_ids.is_cuda)
    module = models.actor.module
    with merged_lora(module), only_settings(module, settings), rollout_hooks(module, models, recorder, stop):
        return models.rollout.generate(request, sampling)


class EndedAtEOS:
    """A stopping criterion: a row is finished once it has sampled EOS (HF generate keeps rows finished),
    so generate() returns when every row has ended — under synced_gpus when every rank's rows have. The
    rollout API passes eos_token_id=None (it never stops early) and pads after each row's first EOS
    itself; the rows are sampled exactly as before, the batch just ends at its longest response."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return input_ids[:, -1] == self.eos_id


class RepairInvalid:
    """transformers' InfNanRemoveLogitsProcessor (nan -> 0, +-inf -> the float's max/min), run only when a
    row has a non-finite value: one reduction per step instead of three full passes. A diverged actor (nan
    logits) then samples garbage instead of raising in torch.multinomial on one rank; its nan log-probs stop
    the stage in update() on every rank at once. Finite scores pass untouched (the same samples)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if bool(torch.isfinite(scores.sum())):
            return scores
        from transformers.generation.logits_process import InfNanRemoveLogitsProcessor

        return InfNanRemoveLogitsProcessor()(input_ids, scores)


class SampledLogprobs:
    """The log-prob each sampled token had under the distribution the rollout drew it from — the logits of the
    generating forward (the hybrid engine's inference kernels, the rollout's precision) after temperature,
    top-k and top-p — for the rollout-trainer mismatch (kubealign.rl.correction). A logits processor (it runs
    before generate's own warpers, so it applies the same transformers warpers itself, in generate's order)
    keeps the step's log-softmax; a stopping criterion, called once the sampled token is appended, reads that
    token's entry. One [N, V] step is held at a time."""

    def __init__(self, sampling: Sampling):
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.warpers: list[Any] = []
        if sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k != 0:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.given: torch.Tensor | None = None  # [N, A] as actions() returns: an engine with its own sampler's

    def keep(self, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
        warped = scores.float()
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        self.pending = torch.log_softmax(warped, -1)

    def take(self, input_ids: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.pending = None

    def actions(self, batch: Any) -> torch.Tensor | None:
        """[N, A] the kept log-probs at the actions that produced the response tokens (action t produced
        token t + 1), 0 elsewhere; an engine with its own sampler (vLLM) gives them (`given`); None when
        generate's sampling loop did not run for these rows, so nothing is known of the rollout's log-probs."""
        if self.given is not None:
            return self.given.to(batch.input_ids.device)
        ids = batch.input_ids
        if not self.steps or self.steps[0].shape[0] != ids.shape[0]:
            return None
        sampled = torch.stack(self.steps, 1).to(ids.device)
        out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32, device=ids.device)
        first = batch.response_start_idx.to(ids.device) - 1
        cols = first[:, None] + torch.arange(sampled.shape[1], device=ids.device)
        inside = cols < out.shape[1]
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(cols)
        out[rows[inside], cols[inside]] = sampled[inside].float()
        return out


class _Keep:
    """SampledLogprobs's logits processor: returns the scores untouched."""

    def __init__(self, recorder: SampledLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.recorder.keep(input_ids, scores)
        return scores


class _Take:
    """SampledLogprobs's stopping criterion: never stops a row."""

    def __init__(self, recorder: SampledLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.recorder.take(input_ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def rollout_hooks(
    module: Any, models: PPOModels, recorder: SampledLogprobs | None = None, stop: Any = None
) -> Iterator[None]:
    """module.generate — what both the rollout API and ModuleRollout call — with EndedAtEOS, RepairInvalid
    and synced_gpus added (with a recorder: its processor after RepairInvalid, its criterion). Under
    ZeRO-3 on several ranks each decode forward gathers parameters collectively, so every rank must run the same
    number of forwards: synced_gpus makes generate
    all-reduce the "this rank is done" flag every step and keep a finished rank running forwards (without
    sampling) until every rank is done, so all ranks stop at the same step."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    generate = module.generate
    own = "generate" in vars(module)  # e.g. the hybrid engine's wrapper of an injected model

    def hooked(*args: Any, **kwargs: Any) -> Any:
        kept = [_Keep(recorder)] if recorder is not None else []
        taken = [_Take(recorder)] if recorder is not None else []
        ended = EndedAtEOS(models.tokenizer.eos_token_id)
        more = [stop] if stop is not None else []
        kwargs.setdefault("stopping_criteria", StoppingCriteriaList([ended, *more, *taken]))
        kwargs.setdefault("logits_processor", LogitsProcessorList([RepairInvalid(), *kept]))
        kwargs.setdefault("synced_gpus", models.synced_gpus)
        return generate(*args, **kwargs)

    module.generate = hooked
    try:
        yield
    finally:
        if own:
            module.generate = generate
        else:
            del module.generate


@contextlib.contextmanager
def only_settings(module: Any, settings: Any) -> Iterator[None]:
    """Generation with exactly `settings` (experience.generation_config): the rollout passes only the
    sampling knobs, and every setting it leaves out would come from the checkpoint's own
    generation_config.json (a repetition penalty, a min-p, ...), which the experience's log-probs do not
    describe. The checkpoint's config is put back afterwards, so the exported model keeps it."""
    hf = module.get_base_model() if hasattr(module, "get_base_model") else module
    saved = hf.generation_config
    hf.generation_config = settings
    try:
        yield
    finally:
        hf.generation_config = saved
