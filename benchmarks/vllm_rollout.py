"""The colocated vLLM rollout engine (kubealign/rl/vllm_rollout.py) against HF generate on a tiny model: engine
start-up, load_weights, sampled tokens per second of both at one batch shape, and the largest gap between the
log-probs vLLM returns and the trainer's (log_softmax(logits / temperature) of a full HF forward, fp32).

Runs in the trainer venv with vLLM (.venv-vllm, requirements/lock-vllm.txt). The batch is B prompts x n samples,
max_new_tokens each, sampled at temperature 1 with EOS ending rows (the tiny untrained model rarely samples it,
so nearly every row is max_new_tokens long). Each generator runs once to warm up, then `repeats` times timed.

  .venv-vllm/bin/python benchmarks/vllm_rollout.py                 # -> results/vllm-rollout-tiny-cpu.json
  .venv-vllm/bin/python benchmarks/vllm_rollout.py --arch opt --batch 8 --new 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Settings:
    vllm_memory: float = 0.3
    vllm_sleep: bool = True
    vllm_kv_cache_gib: float = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "opt"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS / "vllm-rollout-tiny-cpu.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kubealign.models import tiny
    from kubealign.models.token_logprobs import forward_logits
    from kubealign.rl.vllm_rollout import VLLMRollout

    path = tiny.ensure(args.arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    started = time.perf_counter()
    engine = VLLMRollout(str(path), tokenizer, "float32", seed=0, settings=Settings())
    startup = time.perf_counter() - started
    loads = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        engine.load_weights(model)
        loads.append(time.perf_counter() - started)

    texts = [f"Human: question number {i} about {'things ' * (i % 5)}? Assistant:" for i in range(args.batch)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    request = RolloutRequest(enc["input_ids"], enc["attention_mask"])
    sampling = SamplingConfig(max_new_tokens=args.new, temperature=1.0, n_samples_per_prompt=args.samples)

    def vllm_once() -> int:
        batch = engine.generate(request, sampling)
        return int(batch.attention_mask[:, request.prompt_ids.shape[1] :].sum())

    def hf_once() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=request.prompt_ids,
                attention_mask=request.prompt_attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new,
                num_return_sequences=args.samples,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        return int((out[:, request.prompt_ids.shape[1] :] != tokenizer.pad_token_id).sum())

    speed = {name: tokens_per_second(fn, args.repeats) for name, fn in (("vllm", vllm_once), ("hf", hf_once))}

    temperature = 0.7
    batch = engine.generate(request, SamplingConfig(max_new_tokens=args.new, temperature=temperature))
    with torch.no_grad():
        logits = forward_logits(model, batch.input_ids, batch.attention_mask)[:, :-1] / temperature
    trainer = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ids = batch.input_ids
    actions = batch.attention_mask[:, 1:].bool() & (
        torch.arange(ids.shape[1] - 1) >= batch.response_start_idx[:, None] - 1
    )
    gap = (engine.last_logprobs - trainer)[actions].abs()
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "arch": f"tiny-{args.arch}",
        "shape": {"prompts": args.batch, "samples": args.samples, "max_new_tokens": args.new},
        "engine_startup_s": round(startup, 2),
        "load_weights_s": [round(s, 4) for s in loads],
        "tokens_per_s": speed,
        "vllm_over_hf": round(speed["vllm"]["median"] / speed["hf"]["median"], 2),
        "logprob_gap": {"max": gap.max().item(), "mean": gap.mean().item(), "tokens": int(actions.sum())},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


def tokens_per_second(fn, repeats: int) -> dict:
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - started))
    rates.sort()
    return {"median": round(rates[len(rates) // 2], 1), "all": [round(r, 1) for r in rates]}


if __name__ == "__main__":
    main()
