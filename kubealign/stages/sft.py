"""Stage 1, sft: supervised fine-tuning of a causal LM on phase-1 (prompt, chosen) pairs.

Loss on response tokens only by default (the prompt is context, not a target);
`sft.include_prompt_in_loss` also trains on the prompt, as DeepSpeed-Chat does. Perplexity on the
phase-1 eval split (response tokens) before training, every `eval_every_steps`, and at the end.
Output: a self-contained HF model dir (adapters merged) and result.json.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from kubealign.config import KubealignConfig
from kubealign.data import phases
from kubealign.models import loading
from kubealign.outputs import check_output_path
from kubealign.tracking import stage_run
from kubealign.training import checkpoints, distributed, loop
from kubealign.training.engine import apply_lora, ds_config, zero3_loading
from kubealign.training.lm import batch_loss, collate, tokenize

STAGE = "sft"


def perplexity(engine: Any, examples: list[Any], pad_id: int, batch_size: int) -> dict[str, float]:
    """exp(mean NLL) over the loss tokens of `examples`, computed across ranks."""
    import torch.distributed as dist

    engine.eval()
    nll, tokens = 0.0, 0.0
    with torch.no_grad():
        for batch, weight in loop.shard_batches(examples, batch_size, dist.get_rank(), dist.get_world_size()):
            out = batch_loss(engine, collate(batch, pad_id), fp32=True)
            nll += weight * float(out.nll_sum)
            tokens += weight * float(out.tokens)
    engine.train()
    nll, tokens = distributed.all_reduce_sum([nll, tokens])
    return {"perplexity": math.exp(nll / max(tokens, 1.0)), "loss": nll / max(tokens, 1.0)}


def run(
    config: KubealignConfig,
    data: Path,
    model_name: str | None,
    output: Path,
    resume: bool = False,
    checkpoint_location: Path | None = None,
) -> dict:
    """Fine-tune `model_name` (default: sft.model) on DATA's phase 1; returns the result.json payload."""
    cfg = config.sft if model_name is None else config.sft.model_copy(update={"model": model_name})
    check_output_path(output, STAGE)
    checkpoint_dir = checkpoints.checkpoint_dir(output, resume, checkpoint_location)
    dataset = phases.load(data, "phase1_sft")
    _, world = distributed.init()
    distributed.seed_everything(cfg.seed)
    started = time.perf_counter()
    with stage_run(STAGE, config, output.resolve().parent, required=False) as tracker:
        tokenizer = loading.load_tokenizer(cfg.model, cfg.trust_remote_code)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        train = tokenize(dataset["train"], tokenizer, cfg.max_seq_len, cfg.include_prompt_in_loss)
        evals = tokenize(dataset["eval"], tokenizer, cfg.max_seq_len, include_prompt=False)
        with zero3_loading(ds_config(cfg, world, torch.cuda.is_available())):
            model = loading.load_causal_lm(cfg.model, cfg.trust_remote_code, dtype=loading.torch_dtype(cfg.dtype))
            model = apply_lora(model, cfg.lora, "CAUSAL_LM")
        pad = tokenizer.pad_token_id
        task = loop.Task(
            name=STAGE,
            cfg=cfg,
            train=train,
            collate=lambda b: collate(b, pad),
            loss=lambda engine, batch: batch_loss(engine, batch, cfg.fp32_loss).loss,
            evaluate=lambda engine: perplexity(engine, evals, pad, cfg.micro_batch_size),
            checkpoint_dir=checkpoint_dir,
            resume=resume,
        )
        engine, summary = loop.run(task, model, tracker)
        summary["wall_time_s"] = time.perf_counter() - started
        result = {
            "stage": STAGE,
            "metrics": summary,
            "outputs": {"model": "."},
            "base_model": cfg.model,
            "history": task.history,
            "tracked_metrics": list(tracker.history),  # every metric, whether MLflow got it or not
            "train_rows": len(train),
            "eval_rows": len(evals),
        }
        from transformers import AutoModelForCausalLM

        loop.finish(task, engine, AutoModelForCausalLM, "CAUSAL_LM", tokenizer, output, result, tracker)
    return {**result, "output": str(output), "run_id": tracker.run_id}
