"""Causal-LM examples and their loss: (prompt, response) rows -> token ids with a loss mask -> batches ->
masked next-token NLL, the LM head computed at the loss tokens only. Used by SFT, by PPO's unsupervised
(PPO-ptx) term and by evaluation's perplexity."""

from __future__ import annotations

from typing import Any

import torch

from kubealign.data.tokenize import Encoded, encode_pair, pad_batch
from kubealign.models.token_logprobs import Settings, target_logprobs
from kubealign.training import distributed
from kubealign.training.losses import TokenLoss, token_loss


def tokenize(rows: Any, tokenizer: Any, max_len: int, include_prompt: bool) -> list[dict[str, list[int]]]:
    """Rows with prompt/chosen columns -> {input_ids, loss_mask}; the prompt is masked unless include_prompt."""
    return [
        example(encode_pair(tokenizer, prompt, chosen, max_len), include_prompt)
        for prompt, chosen in zip(rows["prompt"], rows["chosen"], strict=True)
    ]


def example(enc: Encoded, include_prompt: bool) -> dict[str, list[int]]:
    """One encoded sequence -> {input_ids, loss_mask}: every token a target, or the response's only; never the
    tools' answers in a demonstration (Encoded.observed): the model does not write them."""
    mask = [1] * len(enc.input_ids)
    if not include_prompt:
        mask[: enc.prompt_len] = [0] * enc.prompt_len
    for j, flag in enumerate(enc.observed):
        if flag:
            mask[enc.prompt_len + j] = 0
    return {"input_ids": enc.input_ids, "loss_mask": mask}


def collate(examples: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    ids, attention = pad_batch([e["input_ids"] for e in examples], pad_id)
    loss_mask, _ = pad_batch([e["loss_mask"] for e in examples], 0)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(attention),
        "loss_mask": torch.tensor(loss_mask),
    }


def batch_loss(model: Any, batch: dict[str, torch.Tensor], fp32: bool) -> TokenLoss:
    """The masked next-token NLL of a collated batch, with the LM head and the log-softmax at the loss
    tokens only (models.token_logprobs: equal to lm_loss on the full logits to float32 rounding). fp32:
    the log-softmax in float32 (else in the model's dtype)."""
    device = distributed.device()
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch["loss_mask"]
    out = target_logprobs(model, batch["input_ids"], batch["attention_mask"], mask[:, 1:], Settings(fp32=fp32))
    return token_loss(out.logprobs, mask)


def loss_tokens(example: dict[str, list[int]]) -> int:
    """The tokens an example's loss counts: its loss-mask positions after the first (lm_loss's targets)."""
    return sum(example["loss_mask"][1:])


def step_loss(out: TokenLoss, batch: dict[str, torch.Tensor], scale: int) -> torch.Tensor:
    """The micro-batch's share of its optimizer step's token-mean loss: summed NLL over the step's loss
    tokens (batch["step_units"], all ranks and micro-batches), times `scale` = accumulation steps x ranks,
    which DeepSpeed divides back out (1 / accumulation per micro-batch, the mean over ranks of gradients).
    So the step's gradient is that of the mean NLL over all its tokens, whatever the grouping; a mean per
    micro-batch instead would weigh a token of a short batch more than one of a long batch. Without
    step_units (no plan): the micro-batch's own mean."""
    if "step_units" not in batch:
        return out.loss
    return out.nll_sum / batch["step_units"].to(out.nll_sum).clamp(min=1) * scale
