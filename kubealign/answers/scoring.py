"""Scoring answers: the scorer's score of each sample row, the KL of one model to another on its rows, and the
figures the promotion guards read that come from the models and their answers.

`score` is the one call evaluate and the online judge both score with (rewards.scorer: the reward model at each
response's EOS and / or the reward functions, weighted); multi-turn rows are scored on their whole trajectory.
The held-out reward model the reward task trains beside the main one (data.split.HELDOUT) scores both models'
answers a second time: the guard against a policy that learned the main reward model's blind spots. The
held-out log-likelihood of reference answers (the capability guard's figure) and the degeneration figures of
the answers (selection.comparison.degeneration) complete what kubealign.promotion.guards reads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kubealign.answers.sampling import batched
from kubealign.config import KubealignConfig
from kubealign.config.schema import EvaluateConfig
from kubealign.data import phases
from kubealign.data.split import HELDOUT
from kubealign.models.value_head import load_reward_model
from kubealign.rewards.scorer import Scorer
from kubealign.rl.experience import paired_logprobs
from kubealign.rl.losses import Sampling
from kubealign.selection.comparison import degeneration, heldout_comparison


@torch.no_grad()
def score(scorer: Scorer, rows: list[dict[str, Any]], size: int, data: phases.Rows | None = None) -> None:
    """Each sample row gets "score" (the scorer's) and "fn" (each reward function's value, None where it does not
    apply); `data` holds the phase-3 rows the samples were drawn for, in the same order."""
    done = 0
    for chunk, ids, attention, response in batched(rows, size):
        part = data.take(list(range(done, done + len(chunk)))) if data is not None else None
        if "read" in chunk[0]:  # a multi-turn answer: the functions read the whole trajectory (answers.turns)
            width = response.shape[1]
            response = torch.stack([torch.nn.functional.pad(r["read"], (0, width - r["read"].shape[0])) for r in chunk])
        scores, values = scorer.score(ids, attention, response, part)
        for i, (row, value) in enumerate(zip(chunk, scores, strict=True)):
            row["score"] = value
            row["fn"] = {name: vs[i] for name, vs in values.items()}
        done += len(chunk)


@torch.no_grad()
def kl_to(candidate: Any, baseline: Any, rows: list[dict[str, Any]], size: int, sampling: Sampling) -> float:
    """Monte-Carlo KL(candidate || baseline) on the candidate's samples: the mean over them of the summed
    log-prob difference on response tokens, both models' log-probs at the sampling temperature without the
    top-k / top-p filter (experience.paired_logprobs, losses.scaled_logits): 0 for a model against
    itself, finite always."""
    total = 0.0
    for _chunk, ids, attention, response in batched(rows, size):
        logprobs, base_logprobs = paired_logprobs(candidate, baseline, ids, attention, response, sampling)
        total += float((logprobs - base_logprobs).sum())
    return total / max(len(rows), 1)


@torch.no_grad()
def heldout_logprob(model: Any, tokenizer: Any, rows: Any, cfg: EvaluateConfig, max_len: int) -> float:
    """The mean log-likelihood per token (nats) the model gives the held-out reference answers (`rows`' chosen,
    after their prompts; prompt tokens are not targets): the capability guard's figure, perplexity = exp(-it)."""
    from kubealign.training.lm import batch_loss, collate, tokenize

    examples = tokenize(rows, tokenizer, max_len, include_prompt=False)
    nll, count = 0.0, 0.0
    for i in range(0, len(examples), cfg.batch_size):
        out = batch_loss(model, collate(examples[i : i + cfg.batch_size], tokenizer.pad_token_id), fp32=True)
        nll, count = nll + float(out.nll_sum), count + float(out.tokens)
    return -nll / max(count, 1.0)


def heldout_dir(reward: Path | None) -> Path | None:
    """The held-out reward model the reward task trained beside REWARD, when there is one."""
    if reward is None or not (Path(reward) / HELDOUT / "config.json").is_file():
        return None
    return Path(reward) / HELDOUT


def heldout_figures(reward: Path | None, tokenizer: Any, base: list[dict], cand: list[dict], size: int) -> dict:
    """The held-out reward model's scores of both models' answers (rows get "heldout_score") and the figures of
    comparison.heldout_comparison; with no reward model scoring, reward_model_used 0 (the guard does not apply);
    with one but no held-out model beside it, no figure (promote then names the missing guard figure)."""
    if reward is None:
        return {"reward_model_used": 0.0}
    directory = heldout_dir(reward)
    if directory is None:
        return {"reward_model_used": 1.0}
    model = load_reward_model(str(directory), False, tokenizer.pad_token_id, "fp32").eval()
    held = Scorer(model, 1.0, None, tokenizer)
    for rows in (base, cand):
        for chunk, ids, attention, response in batched(rows, size):
            for row, value in zip(chunk, held.score(ids, attention, response, None).total, strict=True):
                row["heldout_score"] = value
    return {"reward_model_used": 1.0, **heldout_comparison(base, cand)}


def guard_figures(config: KubealignConfig, prompts: Path, tokenizer: Any, models: dict[str, tuple[Any, list]]) -> dict:
    """What the promotion guards read, for each model ({"baseline" | "candidate": (model, its sample rows)}):
    the held-out log-likelihood per token and its perplexity (when the prompts hold phase1_sft), and the
    degeneration figures of its answers."""
    figures: dict[str, float] = {}
    sft_eval = phases.load(prompts, "phase1_sft")["eval"] if (Path(prompts) / "phase1_sft").is_dir() else None
    for name, (model, rows) in models.items():
        if sft_eval is not None:
            logprob = heldout_logprob(model, tokenizer, sft_eval, config.evaluate, config.sft.max_seq_len)
            figures[f"{name}_heldout_logprob"], figures[f"{name}_perplexity"] = logprob, math.exp(-logprob)
        figures.update(degeneration(rows, tokenizer.eos_token_id, name))
    return figures
