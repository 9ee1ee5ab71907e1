"""Losses and scores of the SFT and reward stages — pure functions of tensors.

Shapes: B = batch, T = sequence length, V = vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class TokenLoss(NamedTuple):
    loss: torch.Tensor  # scalar: mean NLL over the counted tokens
    nll_sum: torch.Tensor  # scalar: summed NLL (for perplexity over many batches)
    tokens: torch.Tensor  # scalar: number of counted tokens


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions that ignore padding on either side: 0 at each sequence's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, fp32: bool = True) -> TokenLoss:
    """Next-token cross entropy. logits [B, T, V] predict input_ids[:, 1:]; loss_mask [B, T] marks the
    tokens to learn (as targets), so loss_mask[:, 0] is never used. fp32 upcasts logits first."""
    logits = logits[:, :-1]
    if fp32:
        logits = logits.float()
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(logits.dtype)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    nll_sum = (nll.view_as(mask) * mask).sum()
    tokens = mask.sum()
    return TokenLoss(nll_sum / tokens.clamp(min=1), nll_sum, tokens)


def last_token_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token values -> [B] the value at each row's last non-pad token (left or right
    padding alike: the rightmost position whose mask is 1)."""
    positions = torch.arange(values.shape[1], device=values.device)
    last = (attention_mask.long() * positions).argmax(-1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs ([B] scores each).

    InstructGPT eq. 1 on whole-sequence scores. DeepSpeed-Chat instead averages the per-token value
    difference from the first token where chosen and rejected diverge to the end; scoring the final
    token only matches what the PPO stage uses as the reward, and needs no divergence search.
    """
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()
