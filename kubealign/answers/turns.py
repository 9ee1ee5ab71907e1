"""Answers in turns, with tools: the baseline's and the candidate's answers sampled as the policy trained
(rl.multiturn), and what their tool use looked like.

Each sample row is answers.sampling's (ids, attention, response, tokens) with `read` besides: the trajectory
after the prompt (the model's turns and the observations), what the reward functions score, while `response` —
what the KL to the baseline sums over — holds the model's own tokens only. Figures per model: the share of
answers that called a tool (tool_call_rate), the share of calls that were malformed (malformed_call_rate),
and model turns per answer (turns_mean); promote.metric may name any of them (e.g. tool_call_rate/candidate).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from kubealign.config.schema import EvaluateConfig
from kubealign.data.tokenize import pad_batch
from kubealign.rl import multiturn
from kubealign.rl.rollout import generation_config


def hf_sampler(model: Any, settings: Any) -> Any:
    """multiturn.rollout's `sample` over a plain transformers model's generate with evaluate's settings."""
    from transformers import StoppingCriteriaList

    def sample(models: Any, ids: torch.Tensor, mask: torch.Tensor, cfg: Any, max_new_tokens: int, samples: int, stop):
        settings.max_new_tokens = max_new_tokens
        stops = StoppingCriteriaList([stop])
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings, stopping_criteria=stops)
        return SimpleNamespace(input_ids=out)

    return sample


def sample_turns(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    cfg: EvaluateConfig,
    session: multiturn.ToolSession,
    data: Any,
    sampling: Any,
) -> list[dict[str, Any]]:
    """answers.sampling.sample in turns: the same seed for every model, one answer per prompt."""
    rows: list[dict[str, Any]] = []
    torch.manual_seed(cfg.seed)
    sampler = hf_sampler(model, generation_config(sampling, cfg.max_new_tokens, tokenizer))
    turn = SimpleNamespace(group_size=1, max_new_tokens=cfg.max_new_tokens)  # what rollout reads of a PPOConfig
    for i in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[i : i + cfg.batch_size]
        ids, mask = (torch.tensor(x) for x in pad_batch(chunk, tokenizer.pad_token_id, "left"))
        part = data.take(list(range(i, i + ids.shape[0]))) if data is not None else None
        batch = multiturn.rollout(None, ids, mask, turn, session, part, sampler)
        width = int(batch.response_start_idx[0])
        for r in range(ids.shape[0]):
            tokens = batch.input_ids[r, width:][batch.attention_mask[r, width:].bool()].tolist()
            rows.append(
                {
                    "ids": batch.input_ids[r],
                    "attention": batch.attention_mask[r],
                    "response": batch.response_mask[r],
                    "read": batch.trajectory_mask[r],
                    "tokens": tokens,
                    "turns": int(batch.turns[r]),
                    "calls": int(batch.calls[r]),
                    "malformed": int(batch.malformed[r]),
                }
            )
    return rows


def turn_figures(base: list[dict[str, Any]], cand: list[dict[str, Any]]) -> dict[str, float]:
    """tool_call_rate, malformed_call_rate and turns_mean of each model's answers (empty without tools)."""
    out: dict[str, float] = {}
    for name, rows in (("baseline", base), ("candidate", cand)):
        if not rows or "turns" not in rows[0]:
            return {}
        calls = sum(r["calls"] for r in rows)
        out[f"tool_call_rate/{name}"] = sum(r["calls"] > 0 for r in rows) / len(rows)
        out[f"malformed_call_rate/{name}"] = sum(r["malformed"] for r in rows) / calls if calls else 0.0
        out[f"turns_mean/{name}"] = sum(r["turns"] for r in rows) / len(rows)
    return out
