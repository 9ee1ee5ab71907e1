"""The log-probabilities of a causal LM's target tokens, computed where a loss needs them only.

A loss over next-token predictions (SFT's NLL, DPO's sequence log-probs, PPO's ratios, evaluation's
perplexity) reads one number per *target* position, yet the usual path computes the LM head for every
position of every row and a float32 log-softmax over the whole vocabulary — a [B, T, V] tensor — and then
masks most of it away: the prompt (most of an HH dialogue) and the right padding. Here the model's body
runs to its last hidden states, the positions the `targets` mask marks are gathered across the batch
([P, H]: every row's own prompt length and padding skipped, not only the columns that are prompt in every
row), and the LM head, the temperature and the log-softmax run on those rows only, `chunk_size` rows at a
time, so no float32 tensor larger than [chunk_size, V] exists. Under autograd, when the targets take more
than one chunk, each chunk is recomputed in the backward pass (torch.utils.checkpoint) instead of keeping
its [chunk_size, V] log-softmax alive: the step's peak memory does not grow with P, for one more head
matmul of those rows in the backward pass (one chunk is kept: it is the bound anyway).

The result equals the full-logits path's to float32 rounding (a matmul of other shapes rounds otherwise),
gradients included (tests/models/test_token_logprobs.py). The body and the head are the modules the model's own
forward calls (`get_decoder()` and `get_output_embeddings()`), for the architectures in FAST_TYPES, whose
causal-LM forward is exactly `lm_head(decoder(...).last_hidden_state)` — no logit scaling or soft-capping
(Gemma 2's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling are not in it). They run
inside the outermost module's own call (its forward swapped for the duration), so a DeepSpeed engine's
forward, its ZeRO-3 parameter hooks and its backward hooks see one forward as before. Anything else (an
unknown architecture, a PEFT prompt-learning wrapper, a stand-in module) takes today's path, the full
logits (from the first column any row targets: logits_to_keep), with one logged note per kind a process.
What the fast path skips: a forward hook on the outermost module that reads or edits `.logits` sees a tuple.

Shapes: B rows, T tokens, A = T - 1 actions (action t is the prediction of token t + 1), H hidden size,
V vocabulary, P target positions in the batch.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kubealign.models.inputs import position_ids

log = logging.getLogger(__name__)

CHUNK_SIZE = 1024  # positions per head + log-softmax chunk: [1024, 50272] float32 is 0.2 GB
# model_type of the causal LMs whose forward is lm_head(get_decoder()(...).last_hidden_state), unscaled
FAST_TYPES = frozenset({"opt", "llama", "gpt2", "mistral", "qwen2", "qwen3", "gpt_neox", "phi3", "gemma"})
_NOTED: set[str] = set()  # the fallback's reasons already logged in this process


class TargetLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [B, A] log-prob of each target token (float32 with fp32), 0 where not a target
    entropy: torch.Tensor | None  # [B, A] next-token entropy at the targets, 0 elsewhere; None: not asked


class Settings(NamedTuple):
    temperature: float = 1.0  # the logits are divided by it (the sampling temperature, rl.losses.scaled_logits)
    fp32: bool = True  # upcast the logits to float32 before the log-softmax
    entropy: bool = False  # also compute the entropy at the targets
    entropy_grad: bool = False  # ... in autograd (else detached: for logging)
    chunk_size: int = 0  # positions per chunk; 0: CHUNK_SIZE


def target_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    settings: Settings | None = None,
) -> TargetLogprobs:
    """[B, T] ids and attention mask, [B, A] targets (bool: action t predicts input_ids[:, t + 1] and is
    counted) -> the target tokens' log-probs (and entropies) at the targets, 0 elsewhere. `model`: a
    causal LM, PEFT-wrapped or not, or a DeepSpeed engine around one. Gradients flow to the model through
    the target positions only (the others are constants 0)."""
    settings = settings or Settings()
    targets = targets.bool()
    tokens = input_ids[:, 1:][targets]  # [P]
    parts = head_parts(model)
    if isinstance(parts, str):
        note_fallback(parts)
        rows = full_logit_rows(model, input_ids, attention_mask, targets)
        flat = chunked(rows, None, tokens, settings)
    else:
        body, head = parts

        def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, **_: Any):
            hidden = body(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
            return chunked(hidden[:, :-1][targets], head, tokens, settings)

        flat = outermost_call(model, forward, input_ids, attention_mask, position_ids=position_ids(attention_mask))
    logprobs = scatter(flat[0], targets)
    return TargetLogprobs(logprobs, scatter(flat[1], targets) if settings.entropy else None)


def head_parts(model: Any) -> tuple[torch.nn.Module, torch.nn.Module] | str:
    """(body, head) of the causal LM under the engine / PEFT wrappers when its logits are exactly
    head(body(...).last_hidden_state); else why not (the fallback's note)."""
    lm = getattr(model, "module", model)
    if hasattr(lm, "get_base_model"):  # PEFT: LoRA layers live inside the base model's modules
        peft_config = getattr(lm, "active_peft_config", None)
        if getattr(peft_config, "is_prompt_learning", False):
            return f"PEFT prompt learning ({type(peft_config).__name__}) adds virtual tokens in its own forward"
        lm = lm.get_base_model()
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAST_TYPES:
        return f"{type(lm).__name__} (model_type {kind!r}) is not one whose logits are known to be lm_head(hidden)"
    for name in ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"{type(lm).__name__} scales its logits ({name}={getattr(config, name)})"
    head, body = lm.get_output_embeddings(), lm.get_decoder()
    if not isinstance(head, torch.nn.Module) or body is lm or not isinstance(body, torch.nn.Module):
        return f"{type(lm).__name__} has no separate decoder and output embeddings"
    return body, head


def note_fallback(reason: str) -> None:
    """One log line per reason and process: the full-logits path is taken."""
    if reason not in _NOTED:
        _NOTED.add(reason)
        log.warning("target log-probs from the full logits (every position, the whole vocabulary): %s", reason)


def outermost_call(
    model: Any, forward: Callable[..., Any], input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any
):
    """forward(input_ids, attention_mask, **kwargs) run as the outermost module's forward: the engine (or the
    module) is called as usual, so DeepSpeed's forward, its ZeRO-3 parameter gathering and the backward hooks
    it puts on the outputs apply to what `forward` returns as they did to the logits."""
    root = getattr(model, "module", model)
    had = root.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) is put back after
    root.forward = forward
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    finally:
        if had is None:
            del root.forward
        else:
            root.forward = had


def chunked(
    rows: torch.Tensor, head: torch.nn.Module | None, tokens: torch.Tensor, settings: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, H] hidden states (or [P, V] logits, head None) and [P] target tokens -> ([P] log-probs, [P]
    entropies, empty unless settings.entropy), chunk by chunk. In autograd, when there is more than one
    chunk, each is recomputed in the backward pass rather than kept, so what stays alive for the backward
    pass is never more than one chunk's [chunk_size, V] log-softmax — what a single chunk keeps anyway, so a
    batch whose targets fit in one chunk keeps it and pays no recomputation. The head runs even on no rows
    (P = 0), so that it is in the graph on every rank, as it always was (ZeRO's gradient reduction expects
    a gradient of every parameter).

    A head partitioned by ZeRO-3 runs once, on all P rows, and is not recomputed: each call of it gathers
    its weight across the ranks, a collective every rank must make as often as the others, while P (so
    the number of chunks) differs by rank."""
    size = settings.chunk_size or CHUNK_SIZE
    if head is not None and any(hasattr(p, "ds_id") for p in head.parameters()):
        size = max(rows.shape[0], 1)
    recompute = rows.shape[0] > size
    logprobs, entropies = [], []
    for start in range(0, max(rows.shape[0], 1), size):
        part, ids = rows[start : start + size], tokens[start : start + size]
        if recompute and torch.is_grad_enabled() and part.requires_grad:
            lp, ent = checkpoint(
                chunk_logprobs, part, head, ids, settings, use_reentrant=False, preserve_rng_state=False
            )
        else:
            lp, ent = chunk_logprobs(part, head, ids, settings)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def chunk_logprobs(
    part: torch.Tensor, head: torch.nn.Module | None, tokens: torch.Tensor, settings: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: the head, the temperature and ONE log-softmax, as rl.losses.scaled_logits and
    logprobs_and_entropy compute them on the full logits. [c, H] -> ([c], [c] or [0])."""
    logits = part if head is None else head(part)
    if settings.fp32:
        logits = logits.float()
    if settings.temperature != 1.0:
        logits = logits / settings.temperature
    logp = F.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not settings.entropy:
        return logprobs, logprobs[:0]
    if settings.entropy_grad:
        return logprobs, entropy_of(logp)
    with torch.no_grad():
        return logprobs, entropy_of(logp.detach())


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] normalized log-probs -> [...] entropy (rl.losses.entropy_from_logprobs: -inf adds 0)."""
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def scatter(flat: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[P] values in the row-major order of targets' True positions -> [B, A], 0 elsewhere (differentiable)."""
    return flat.new_zeros(targets.shape).masked_scatter(targets, flat)


def full_logit_rows(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The fallback: [P, V] logits of the target positions, out of the model's full logits (those of the
    columns before any row's first target skipped where the model takes logits_to_keep)."""
    first = first_target_column(targets)
    logits = forward_logits(model, input_ids, attention_mask, first)
    return logits[:, :-1][targets[:, first:]]


def first_target_column(targets: torch.Tensor) -> int:
    """The first action column any row targets ([B, A] mask): the columns before it are prompt in every row,
    so a full-logits pass need not compute their logits (0 with no target)."""
    columns = targets.bool().any(0)
    return int(columns.int().argmax()) if bool(columns.any()) else 0


def forward_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, first: int = 0) -> torch.Tensor:
    """[N, T - first, V] logits of positions first..T-1 (a causal LM's logits_to_keep: the LM head and
    everything after it skip the prompt); all T positions for first 0 or a model without logits_to_keep."""
    keep = {"logits_to_keep": input_ids.shape[1] - first} if first > 0 and keeps_logits(model) else {}
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        **keep,
    ).logits
    return logits if keep else logits[:, first:]


def keeps_logits(model: Any) -> bool:
    """Whether the causal LM under the engine / PEFT wrappers takes logits_to_keep (transformers' LMs do)."""
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "logits_to_keep" in inspect.signature(base.forward).parameters
