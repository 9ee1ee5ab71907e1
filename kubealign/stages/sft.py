"""Stage 1, sft: supervised fine-tuning of a causal LM on phase-1 (prompt, chosen) pairs.

Loss on response tokens only by default (the prompt is context, not a target);
`sft.include_prompt_in_loss` also trains on the prompt, as DeepSpeed-Chat does. Perplexity on the
phase-1 eval split (response tokens) before training, every `eval_every_steps`, and at the end.
Output: a self-contained HF model dir (adapters merged) and result.json.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kubealign.config import KubealignConfig
from kubealign.data import phases
from kubealign.models import loading
from kubealign.tracking.lineage import phase_ref
from kubealign.training import distributed, loop, stage
from kubealign.training.engine import apply_lora, ds_config, zero3_loading
from kubealign.training.lm import batch_loss, collate, loss_tokens, step_loss, tokenize

STAGE = "sft"


def sequence_length(example: dict[str, list[int]]) -> int:
    return len(example["input_ids"])


def perplexity(engine: Any, examples: list[Any], pad_id: int, batch_size: int) -> dict[str, float]:
    """exp(mean NLL) over the loss tokens of `examples`, computed across ranks."""
    import torch.distributed as dist

    engine.eval()
    nll, tokens = 0.0, 0.0
    with torch.no_grad():
        for batch, weight in loop.shard_batches(
            examples, batch_size, dist.get_rank(), dist.get_world_size(), sequence_length
        ):
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

    def build(dataset: Any, tokenizer: Any, world: int, tracker: Any) -> stage.Built:
        from transformers import AutoModelForCausalLM

        train = tokenize(dataset["train"], tokenizer, cfg.max_seq_len, cfg.include_prompt_in_loss)
        evals = tokenize(dataset["eval"], tokenizer, cfg.max_seq_len, include_prompt=False)
        with zero3_loading(ds_config(cfg, world, torch.cuda.is_available())):
            dtype = loading.torch_dtype(cfg.dtype)
            model = loading.load_causal_lm(
                cfg.model, cfg.trust_remote_code, dtype=dtype, **loading.revision_kw(cfg.revision)
            )
            model = apply_lora(model, cfg.lora, "CAUSAL_LM")
        pad = tokenizer.pad_token_id
        scale = cfg.gradient_accumulation_steps * world
        return stage.Built(
            model=model,
            train=train,
            evals=evals,
            collate=lambda b: collate(b, pad),
            loss=lambda engine, batch: step_loss(batch_loss(engine, batch, cfg.fp32_loss), batch, scale),
            evaluate=lambda engine: perplexity(engine, evals, pad, cfg.micro_batch_size),
            model_cls=AutoModelForCausalLM,
            task_type="CAUSAL_LM",
            result={"train_rows": len(train), "eval_rows": len(evals)},
            length=sequence_length,
            units=loss_tokens,
        )

    load = lambda: phases.load(data, "phase1_sft")  # noqa: E731
    ref = phase_ref(data, "phase1_sft", "training")  # the run names the data it trains on
    return stage.run(STAGE, config, cfg, load, build, output, resume, checkpoint_location, data=ref)
