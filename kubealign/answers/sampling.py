"""Sampling a model's answers: held-out prompts in, one seeded answer per prompt out, as sample rows.

Every model samples with the same seed and settings (the evaluate section: temperature, top-k / top-p,
max_new_tokens, batch_size), so two models' rows are paired prompt by prompt: evaluate compares the baseline
with the candidate on them, the feedback push shows two registered versions' answers to people. A sample row is
{"ids": prompt + answer, "attention", "response" (masks over ids, the response one shifted by one as the
log-probs are), "tokens": the answer's token ids}; answers.scoring adds its scores. With tools the answers are
sampled in turns, as the policy trained (answers.turns).
"""

from __future__ import annotations

from typing import Any

import torch

from kubealign.answers import turns
from kubealign.config import KubealignConfig
from kubealign.config.schema import EvaluateConfig
from kubealign.data.tokenize import pad_batch
from kubealign.rl import multiturn
from kubealign.rl.experience import response_masks
from kubealign.rl.losses import Sampling
from kubealign.rl.rollout import generation_config


@torch.no_grad()
def sample(model: Any, tokenizer: Any, prompts: list[list[int]], cfg: EvaluateConfig) -> list[dict[str, Any]]:
    """Seeded sampling: the same seed and settings for every model, so the comparison is paired."""
    rows = []
    torch.manual_seed(cfg.seed)
    settings = generation_config(Sampling.of(cfg), cfg.max_new_tokens, tokenizer)
    for i in range(0, len(prompts), cfg.batch_size):
        ids, mask = (
            torch.tensor(x) for x in pad_batch(prompts[i : i + cfg.batch_size], tokenizer.pad_token_id, "left")
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        start = torch.full((out.shape[0],), ids.shape[1])
        attention, response = response_masks(out, mask, start, tokenizer.eos_token_id)
        for row in range(out.shape[0]):
            tokens = out[row][attention[row].bool()][int(mask[row].sum()) :].tolist()
            rows.append({"ids": out[row], "attention": attention[row], "response": response[row], "tokens": tokens})
    return rows


def sampled(config: KubealignConfig, runner: Any, tokenizer: Any, encoded: list, data: Any, models: tuple) -> tuple:
    """(baseline's rows, candidate's rows): sampled in turns with the tools when there are tools, as the policy
    was trained (answers.turns), else one answer each."""
    cfg = config.evaluate
    if config.tools.enabled:
        session = multiturn.ToolSession(config.tools, runner, tokenizer)
        return tuple(turns.sample_turns(m, tokenizer, encoded, cfg, session, data, Sampling.of(cfg)) for m in models)
    return tuple(sample(m, tokenizer, encoded, cfg) for m in models)


def batched(rows: list[dict[str, Any]], size: int):
    """(rows, ids, attention, response) batches; rows of one generate call share one width already."""

    def stack(chunk: list[dict[str, Any]], key: str, width: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r[key], (0, width - r[key].shape[0])) for r in chunk])

    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        width = max(int(r["attention"].shape[0]) for r in chunk)
        yield chunk, stack(chunk, "ids", width), stack(chunk, "attention", width), stack(chunk, "response", width - 1)
