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


def token_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> TokenLoss:
    """lm_loss from the targets' log-probs: [B, T-1] log-probs of input_ids[:, 1:] (0 or anything where
    not a target) and the [B, T] loss_mask -> the same TokenLoss, without the [B, T, V] logits."""
    mask = loss_mask[:, 1:].to(logprobs.dtype)
    nll_sum = -(logprobs * mask).sum()
    tokens = mask.sum()
    return TokenLoss(nll_sum / tokens.clamp(min=1), nll_sum, tokens)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), averaged over pairs ([B] scores each).

    InstructGPT eq. 1 on whole-sequence scores. DeepSpeed-Chat instead averages the per-token value
    difference from the first token where chosen and rejected diverge to the end; scoring the final
    token only matches what the PPO stage uses as the reward, and needs no divergence search.
    """
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()
