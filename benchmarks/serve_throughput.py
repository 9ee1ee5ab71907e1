"""Serving throughput: vLLM's OpenAI server (what `kubealign serve` runs) against transformers' generate.

The same model directory, the same prompts, greedy, every answer exactly --new-tokens long (vLLM:
ignore_eos; transformers: min_new_tokens), fp32 on CPU. vLLM at 1 and 16 requests in flight (threads posting
to /v1/completions); transformers' generate at batch 1 and 16 (left-padded batches of the same prompts).
Requests/s and generated tokens/s of each, and vLLM's ratio to transformers at the same concurrency,
measured in one run on one machine. Results: benchmarks/results/serve-<model>-<device>.json.

  python benchmarks/serve_throughput.py                      # tiny-opt (the demo's model)
  python benchmarks/serve_throughput.py --shape opt-125m     # OPT-125M's shape, random weights
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from train_throughput import SHAPES, build_shaped, machine  # noqa: E402

SHAPES.setdefault(
    "opt-125m",
    {
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "word_embed_proj_dim": 768,
    },
)


def prompts(n: int) -> list[str]:
    """n synthetic-task prompts (data-split's generator), as the demo's evaluate sees them."""
    from kubealign.data import synthetic

    rows = synthetic.generate(pairs=n, sft_rows=0, seed=0)
    return [row["prompt"] for row in rows][:n]


def post(port: int, payload: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def vllm_rate(port: int, name: str, texts: list[str], new_tokens: int, concurrency: int) -> dict:
    payload = {"model": name, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    post(port, {**payload, "prompt": texts[0]})  # warm
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda t: post(port, {**payload, "prompt": t}), texts))
    wall = time.perf_counter() - start
    tokens = sum(d["usage"]["completion_tokens"] for d in done)
    return {"requests_per_s": len(texts) / wall, "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def transformers_rate(model_dir: Path, texts: list[str], new_tokens: int, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    settings = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id,
    }
    with torch.no_grad():
        model.generate(**tokenizer(texts[:1], return_tensors="pt"), **settings)  # warm
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), batch):
            inputs = tokenizer(texts[i : i + batch], return_tensors="pt", padding=True)
            out = model.generate(**inputs, **settings)
            tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    wall = time.perf_counter() - start
    return {"requests_per_s": len(texts) / wall, "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["tiny-opt", *SHAPES], default="tiny-opt")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8431)
    args = parser.parse_args()

    from kubealign.config.serve import ServeConfig
    from kubealign.models import loading
    from kubealign.serving import local, vllm_env

    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.shape == "tiny-opt"
        model_dir = Path(loading.resolve("tiny-opt")) if tiny else build_shaped(args.shape, Path(tmp) / "model")
        texts = prompts(args.requests)
        cfg = ServeConfig()
        argv = local.command(vllm_env.python(), model_dir, "bench", args.port, cfg, None)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}
        started = time.perf_counter()
        proc = local.run_server(argv, env, Path(tmp) / "vllm.log", args.port, cfg.start_timeout_s)
        start_s = time.perf_counter() - started
        try:
            results = {f"vllm_c{c}": vllm_rate(args.port, "bench", texts, args.new_tokens, c) for c in (1, 16)}
        finally:
            local.stop(proc)
        for batch in (1, 16):
            results[f"transformers_b{batch}"] = transformers_rate(model_dir, texts, args.new_tokens, batch)
    ratios = {
        f"vllm_over_transformers_at_{c}": results[f"vllm_c{c}"]["tokens_per_s"]
        / results[f"transformers_b{c}"]["tokens_per_s"]
        for c in (1, 16)
    }
    record = {
        "model": args.shape,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "dtype": "float32",
        "vllm_start_s": start_s,
        "results": results,
        "ratios": ratios,
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
    }
    device = "gpu" if "gpu" in record["machine"] else "cpu"
    out = HERE / "results" / f"serve-{args.shape}-{device}.json"
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for key, value in results.items():
        print(f"{key:>18}: {value['requests_per_s']:7.2f} req/s  {value['tokens_per_s']:8.1f} tokens/s")
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
