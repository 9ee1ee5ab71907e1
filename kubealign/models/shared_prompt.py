"""Preference pairs share their prompt: run it through the model once, not once per response.

DPO's batch holds each pair twice, prompt + chosen and prompt + rejected, and the usual forward (TRL's,
DeepSpeed-Chat's, and this project's before) runs the prompt — in HH the dialogue history, most of each
sequence — through every layer for both. Here each pair is one row, prompt + chosen + rejected, with the
positions of both responses continuing the prompt's and an attention mask under which every token sees
what it sees in its own full sequence (causal, and the rejected tokens never the chosen ones): the prompt
is computed once, and a batch holds B rows of P + C + R tokens instead of 2B rows padded to the longest
P + max(C, R). The LM head and the log-softmax then run at the response targets only
(models.token_logprobs): a response's first token is predicted from the prompt's last hidden state, the
others from the previous token of the same response. Loss and gradients equal the two-row path's to float32
rounding (tests/models/test_shared_prompt.py). This is the packing of "Accelerating Direct Preference
Optimization with Prefix Sharing" (Wang et al. 2024); the mask is an additive [B, 1, L, L] one, which
transformers' attention takes as it is (eager and SDPA alike).

`split` says None — and the caller takes the two-row path — where the pairs do not share their prompt token
for token, or a row has no prompt token or no target; `usable` says None where the model cannot take this
path (token_logprobs.head_parts: an unknown architecture, a PEFT prompt-learning wrapper), noted once.

Shapes: B pairs (2B rows in the full batch: the chosen, then the rejected, dpo.collate's order), T tokens of
a full row, L of a packed row, P target tokens in the batch, H hidden size.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kubealign.models.token_logprobs import Settings, chunked, head_parts, note_fallback, outermost_call, scatter


class SharedPrompt(NamedTuple):
    input_ids: torch.Tensor  # [B, L] one row per pair: prompt, chosen response, rejected response; right-padded
    position_ids: torch.Tensor  # [B, L] both responses continue the prompt: P.., P..; 0 on padding
    segments: torch.Tensor  # [B, L] PROMPT, CHOSEN, REJECTED or PAD
    sources: torch.Tensor  # [P] the packed position each target's hidden state is read at (row * L + column)
    tokens: torch.Tensor  # [P] the target tokens, in the full batch's row-major order of its targets


PAD, PROMPT, CHOSEN, REJECTED = -1, 0, 1, 2


def split(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> SharedPrompt | None:
    """A right-padded pair batch ([2B, T]: row i and row B + i a pair; loss_mask marks each response's
    target tokens, from its first) -> one packed row per pair; None where a pair does not share its prompt
    token for token, or a row has no prompt token or no target."""
    n = input_ids.shape[0] // 2
    if n == 0 or input_ids.shape[0] != 2 * n:
        return None
    lengths = attention_mask.long().sum(-1).tolist()
    masks = loss_mask.long().tolist()
    starts = [row.index(1) if 1 in row else -1 for row in masks]
    if any(s < 1 for s in starts):
        return None
    ids = input_ids.tolist()
    rows, positions, segments, sources, tokens = [], [], [], [], []
    for i in range(n):
        cut, other = starts[i], n + i
        if starts[other] != cut or ids[other][:cut] != ids[i][:cut]:
            return None
        chosen, rejected = ids[i][cut : lengths[i]], ids[other][cut : lengths[other]]
        rows.append(ids[i][:cut] + chosen + rejected)
        positions.append(list(range(cut + len(chosen))) + list(range(cut, cut + len(rejected))))
        segments.append([PROMPT] * cut + [CHOSEN] * len(chosen) + [REJECTED] * len(rejected))
    width = max(map(len, rows))
    for r in range(2 * n):  # the full batch's targets, row by row: chosen rows first, then rejected rows
        i, cut = r % n, starts[r]
        offset = 0 if r < n else len(rows[i]) - lengths[r]  # where this response's tokens sit after the cut
        for column in range(cut, lengths[r]):
            if masks[r][column]:
                j = column - cut  # response token j: predicted by the prompt's last token (j = 0) or token j - 1
                sources.append(i * width + (cut - 1 if j == 0 else offset + column - 1))
                tokens.append(ids[r][column])
    device, dtype = input_ids.device, input_ids.dtype

    def padded(values: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype, device=device)

    return SharedPrompt(
        padded(rows, 0),
        padded(positions, 0),
        padded(segments, PAD),
        torch.tensor(sources, dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=dtype, device=device),
    )


def attention_bias(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, L, L] additive mask (0: attend, the dtype's min: not): causal over real tokens, except that a
    rejected token never sees a chosen one; a padding query sees itself only (its output is never read)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    real = segments != PAD
    allowed = causal & real[:, None, :] & real[:, :, None]
    allowed &= ~((segments == REJECTED)[:, :, None] & (segments == CHOSEN)[:, None, :])
    allowed |= torch.eye(length, dtype=torch.bool, device=segments.device) & ~real[:, :, None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def usable(model: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(body, head) when the model can run a shared prompt; None (with token_logprobs's one note) if not."""
    parts = head_parts(model)
    if isinstance(parts, str):
        note_fallback(parts)
        return None
    lm = getattr(model, "module", model)
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    kind = getattr(getattr(lm, "config", None), "_attn_implementation", None)
    if kind not in (None, "eager", "sdpa"):  # flash-attention kernels take no [B, 1, L, L] mask
        note_fallback(f"attention {kind!r} takes no custom mask: each pair's prompt is run twice")
        return None
    return parts


def shared_logprobs(
    model: Any, pairs: SharedPrompt, targets: torch.Tensor, parts: tuple[torch.nn.Module, torch.nn.Module]
) -> torch.Tensor:
    """[2B, A] log-probs of the full rows' targets (targets: [2B, A] = loss_mask[:, 1:] of the full batch),
    0 elsewhere, from the packed rows; parts from `usable`."""
    body, head = parts

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> torch.Tensor:
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=pairs.position_ids, use_cache=False
        ).last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1])[pairs.sources]
        return chunked(rows, head, pairs.tokens, Settings())[0]

    bias = attention_bias(pairs.segments, next(head.parameters()).dtype)
    flat = outermost_call(model, forward, pairs.input_ids, bias)  # the engine's forward and hooks see one forward
    return scatter(flat, targets.bool())


def pair_target_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """[2B, A] log-probs of a right-padded pair batch's targets (loss_mask[:, 1:]), 0 elsewhere: the prompt
    run once per pair where `split` and `usable` allow, else token_logprobs.target_logprobs on the full rows."""
    from kubealign.models.token_logprobs import target_logprobs

    pairs = split(input_ids, attention_mask, loss_mask)
    parts = usable(model) if pairs is not None else None
    if pairs is None or parts is None:
        return target_logprobs(model, input_ids, attention_mask, loss_mask[:, 1:]).logprobs
    return shared_logprobs(model, pairs, loss_mask[:, 1:], parts)
