"""Reward / critic models: a transformer with a scalar head, and its per-token values.

The model class is transformers' AutoModelForSequenceClassification with num_labels=1: the saved dir
is a standard HF dir any transformers user can load. Its head (`score`) maps every position's hidden
state to a value; HF then pools at the last non-pad token. We read the per-token values straight from
the head with a forward hook, so one forward serves the critic (all values) and the reward (the value
at the last real token: last_token_scores; both at once: score_and_value) for any architecture with a `score` head.
"""

from __future__ import annotations

from typing import Any

import torch

from kubealign.models import loading
from kubealign.models.inputs import position_ids

HEAD_NAMES = ("score",)


def load_reward_model(
    name: str, trust_remote_code: bool, pad_token_id: int, dtype: str, revision: str | None = None
) -> Any:
    """Load `name` (a causal-LM or reward-model dir, tiny-*, or hub id) with a 1-output value head."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    target = loading.resolve(name)
    # From a causal-LM dir the head is new by design; transformers' multi-line load report says so
    # for every such load, which would bury our own messages.
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = loading._load(
            "reward model",
            AutoModelForSequenceClassification,
            target,
            trust_remote_code,
            num_labels=1,
            dtype=loading.torch_dtype(dtype),
            **loading.revision_kw(revision),
        )
    finally:
        hf_logging.set_verbosity(previous)
    model.config.pad_token_id = pad_token_id  # HF pooling needs it for batches > 1
    return model


def head(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost value-head module (PEFT wraps it in a ModulesToSaveWrapper named the same)."""
    found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in HEAD_NAMES]
    if not found:
        raise ValueError(f"{type(model).__name__} has no value head named one of {HEAD_NAMES}")
    return min(found, key=lambda item: len(item[0]))[1]


def token_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] value of every position (one forward pass)."""
    captured: list[torch.Tensor] = []
    target = head(model.module if hasattr(model, "module") else model)
    handle = target.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    finally:
        handle.remove()
    return captured[-1].squeeze(-1)


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token values -> [B] the value at each row's last non-pad token (left or right
    padding alike: the rightmost position whose mask is 1)."""
    positions = torch.arange(values.shape[1], device=values.device)
    last = (attention_mask.long() * positions).argmax(-1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def score_and_value(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """(per-action values [N, A], sequence scores [N]) from a reward/critic model in one pass."""
    values = token_values(model, input_ids, attention_mask)
    return values[:, :-1], last_token_scores(values, attention_mask)
