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
from kubealign.data.tokenize import encode_pair, pad_batch
from kubealign.models import loading
from kubealign.outputs import check_output_path
from kubealign.tracking import stage_run
from kubealign.training import distributed, loop
from kubealign.training.engine import apply_lora, ds_config, zero3_loading
from kubealign.training.losses import TokenLoss, lm_loss, position_ids

STAGE = "sft"


def tokenize(rows: Any, tokenizer: Any, max_len: int, include_prompt: bool) -> list[dict[str, list[int]]]:
    examples = []
    for prompt, chosen in zip(rows["prompt"], rows["chosen"], strict=True):
        enc = encode_pair(tokenizer, prompt, chosen, max_len)
        mask = [1] * len(enc.input_ids)
        if not include_prompt:
            mask[: enc.prompt_len] = [0] * enc.prompt_len
        examples.append({"input_ids": enc.input_ids, "loss_mask": mask})
    return examples


def collate(examples: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    ids, attention = pad_batch([e["input_ids"] for e in examples], pad_id)
    loss_mask, _ = pad_batch([e["loss_mask"] for e in examples], 0)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(attention),
        "loss_mask": torch.tensor(loss_mask),
    }


def batch_loss(model: Any, batch: dict[str, torch.Tensor], fp32: bool) -> TokenLoss:
    device = distributed.device()
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids(batch["attention_mask"]),
        use_cache=False,
    ).logits
    return lm_loss(logits, batch["input_ids"], batch["loss_mask"], fp32)


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


def run(config: KubealignConfig, data: Path, model_name: str | None, output: Path, resume: bool = False) -> dict:
    """Fine-tune `model_name` (default: sft.model) on DATA's phase 1; returns the result.json payload."""
    cfg = config.sft if model_name is None else config.sft.model_copy(update={"model": model_name})
    check_output_path(output)
    dataset = phases.load(data, "phase1_sft")
    _, world = distributed.init()
    distributed.seed_everything(cfg.seed)
    started = time.perf_counter()
    with stage_run(STAGE, config, output.resolve().parent) as tracker:
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
            checkpoint_dir=Path(f"{output}.checkpoints"),
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
            "train_rows": len(train),
            "eval_rows": len(evals),
        }
        from transformers import AutoModelForCausalLM

        loop.finish(task, engine, AutoModelForCausalLM, "CAUSAL_LM", tokenizer, output, result, tracker)
    return {**result, "output": str(output), "run_id": tracker.run_id}
