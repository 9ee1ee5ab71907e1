"""SFT and DPO loss + backward steps, the full-logits path against the LM head at the loss positions only
(kubealign.models.token_logprobs, issue 56): tokens per second and peak resident memory, one process each.

A small measurement, not the TRL comparison (benchmarks/trl_compare.py): an OPT of width 256, 2 layers and
OPT's vocabulary (50,272), random weights, fp32, on CPU with one torch thread (to leave the machine's other
core alone). SFT: 4 sequences of 400-512 tokens, right-padded, each one's prompt 80 % of it. DPO: 4 pairs
(8 rows: chosen then rejected, one prompt per pair), the same lengths, the reference log-probs constants (a
table, as the stage has it). Each path runs in its own process (a fresh peak RSS): the model is built, one
warm-up step, then `--steps` timed steps of loss + backward (no optimizer step); reported: real (non-padding)
tokens per second and the peak RSS above the process's peak before the first step (model and batch built).

Paths: old = the stages before issue 56 (lm.lm_loss on the full logits; DPO's logits from the first column
any row's response occupies, logits_to_keep), new = lm.batch_loss and stages.dpo.response_logprobs (here every
batch's targets fit in one chunk of 1,024 positions: kept for the backward pass), new-chunk128 = new in chunks
of 128 positions, each recomputed in the backward pass (what a batch of more than 1,024 targets does).

  python benchmarks/target_logprobs.py            # both stages, all paths, 3 steps each (about 2 minutes)
  python benchmarks/target_logprobs.py --steps 1  # a smoke run

The figures go to results/target-logprobs-<label>.json; the last line printed is their JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PATHS = ("old", "new", "new-chunk128")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_throughput import machine  # noqa: E402


def batch(stage: str, seed: int = 0):
    """A collated batch (lm.collate's keys) of sequences of 400-512 tokens, prompts 80 % of each."""
    import torch

    from kubealign.training import lm

    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(4):
        length = int(torch.randint(400, 513, (1,), generator=g))
        prompt = int(0.8 * length)
        rows = 2 if stage == "dpo" else 1
        head = torch.randint(3, 50272, (prompt,), generator=g).tolist()
        for _ in range(rows):  # dpo: chosen and rejected share the prompt, their responses differ in length
            answer = max(8, length - prompt - int(torch.randint(0, 40, (1,), generator=g)))
            ids = head + torch.randint(3, 50272, (answer,), generator=g).tolist()
            examples.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * answer})
    if stage == "dpo":  # chosen rows first, then rejected (stages.dpo.collate)
        examples = examples[0::2] + examples[1::2]
    out = lm.collate(examples, pad_id=1)
    out["index"] = torch.arange(4)
    return out


def model():
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(
        hidden_size=256,
        word_embed_proj_dim=256,
        ffn_dim=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=50272,
        max_position_embeddings=512,
        dropout=0.0,
    )
    return OPTForCausalLM(config).train()


def step(stage: str, path: str, lm_model, data) -> None:
    import torch

    from kubealign.models.inputs import position_ids
    from kubealign.rl.dpo import dpo_loss, sequence_logprobs
    from kubealign.stages import dpo as dpo_stage
    from kubealign.training import lm
    from kubealign.training.losses import lm_loss

    if stage == "sft" and path == "old":
        kw = {k: data[k] for k in ("input_ids", "attention_mask")}
        kw["position_ids"] = position_ids(data["attention_mask"])
        loss = lm_loss(lm_model(**kw, use_cache=False).logits, data["input_ids"], data["loss_mask"]).loss
    elif stage == "sft":
        loss = lm.batch_loss(lm_model, data, fp32=True).loss
    else:
        if path == "old":
            ids, attention, mask = data["input_ids"], data["attention_mask"], data["loss_mask"]
            first = dpo_stage.first_target_column(mask[:, 1:])
            logits = dpo_stage.forward_logits(lm_model, ids, attention, first)
            seq = sequence_logprobs(logits, ids[:, first:], mask[:, first:])
        else:
            seq = dpo_stage.response_logprobs(lm_model, data)
        (pc, pr), ref = dpo_stage.halves(seq, "sigmoid"), torch.zeros(4)
        loss = dpo_loss(pc, pr, ref, ref, 0.1).loss
    loss.backward()


def measure(stage: str, path: str, steps: int) -> dict:
    """One process's figures (the child side)."""
    import torch

    from kubealign.models import token_logprobs

    torch.set_num_threads(1)
    if path == "new-chunk128":
        token_logprobs.CHUNK_SIZE = 128
    lm_model, data = model(), batch(stage)
    tokens = int(data["attention_mask"].sum())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(stage, path, lm_model, data)  # warm-up
    lm_model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for _ in range(steps):
        step(stage, path, lm_model, data)
        lm_model.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "tokens_per_s": tokens * steps / seconds,
        "seconds": seconds,
        "tokens_per_step": tokens,
        "peak_rss_mib": peak / 1024,
        "peak_rss_above_start_mib": (peak - before) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--label", default="opt-256-cpu-1thread")
    parser.add_argument("--child", nargs=2, metavar=("STAGE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.steps)))
        return
    results: dict = {
        "steps": args.steps,
        "threads": 1,
        "machine": machine(),
        "load_average_at_start": os.getloadavg()[0],
    }
    for stage in ("sft", "dpo"):
        for path in PATHS:
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--child", stage, path]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            results[f"{stage}_{path}"] = json.loads(done.stdout.strip().splitlines()[-1])
            print(stage, path, results[f"{stage}_{path}"], flush=True)
        old = results[f"{stage}_old"]
        for path in PATHS[1:]:
            new = results[f"{stage}_{path}"]
            results[f"{stage}_{path}_speedup"] = new["tokens_per_s"] / old["tokens_per_s"]
            results[f"{stage}_{path}_peak_ratio"] = new["peak_rss_above_start_mib"] / old["peak_rss_above_start_mib"]
    out = HERE / "results" / f"target-logprobs-{args.label}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: round(v, 3) for k, v in results.items() if k.endswith(("speedup", "peak_ratio"))}))


if __name__ == "__main__":
    main()
