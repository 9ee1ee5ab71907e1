"""SFT and reward-model training throughput (tokens/s) and peak memory.

Each stage runs as its own `kubealign` process (so peak memory is that stage's alone) on the
built-in synthetic data, and the numbers come from its result.json. Results are written to
benchmarks/results/<label>.json together with the machine they ran on.

  python benchmarks/train_throughput.py                      # tiny-cpu preset, tiny-opt
  python benchmarks/train_throughput.py --shape opt-1.3b     # OPT-1.3B-shaped SFT (random init, GPU)
  python benchmarks/train_throughput.py --shape opt-350m --stages reward

--shape builds a randomly initialized model with the real architecture's dimensions and vocabulary
(no download) and the tiny tokenizer, so tokens/s reflects the real model's compute.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {  # facebook/opt-* config dimensions
    "opt-350m": {
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "word_embed_proj_dim": 512,
    },
    "opt-1.3b": {
        "hidden_size": 2048,
        "ffn_dim": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "word_embed_proj_dim": 2048,
    },
}


def build_shaped(shape: str, directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, OPTConfig

    from kubealign.models import loading

    tokenizer = loading.load_tokenizer("tiny-opt")
    config = OPTConfig(
        vocab_size=50272,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        ),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        found = subprocess.run(query, capture_output=True, text=True, check=False)
        info["driver"] = found.stdout.strip() or None
        for name in ("transformers", "deepspeed"):  # the two a GPU figure depends on besides torch
            info[name] = importlib.metadata.version(name)
    return info


def run_stage(stage: str, split: Path, model: str, out: Path, extra: list[str]) -> dict:
    kubealign = Path(sys.executable).parent / "kubealign"
    cmd = [
        str(kubealign),
        stage,
        "--data",
        str(split),
        "--model",
        model,
        "--output",
        str(out),
        "--set",
        "tracking.enabled=false",
        *extra,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    metrics = json.loads((out / "result.json").read_text())["metrics"]
    keys = ("tokens_per_s", "peak_memory_mb", "train_time_s", "steps", "train_tokens", "world_size")
    return {k: metrics[k] for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random-init model of this shape (default: tiny-opt)")
    parser.add_argument("--stages", nargs="+", default=["sft", "reward"], choices=["sft", "reward"])
    parser.add_argument("--epochs", type=float, default=2.0, help="training epochs per stage")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    parser.add_argument("--label", help="results file name (default: derived from shape and machine)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        split = work / "split"
        kubealign = str(Path(sys.executable).parent / "kubealign")
        split_cmd = [kubealign, "data-split", "--output", str(split), "--set", "tracking.enabled=false"]
        subprocess.run(split_cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
        model = str(build_shaped(args.shape, work / "model")) if args.shape else "tiny-opt"
        results = {}
        for stage in args.stages:
            extra = ["--set", f"{stage}.num_train_epochs={args.epochs}"]
            extra += [a for o in args.overrides for a in ("--set", o)]
            results[stage] = run_stage(stage, split, model, work / stage, extra)
    record = {
        "model": args.shape or "tiny-opt",
        "preset": "tiny-cpu",
        "overrides": args.overrides,
        "epochs": args.epochs,
        "machine": machine(),
        "results": results,
    }
    label = args.label or f"{args.shape or 'tiny-opt'}-{'gpu' if 'gpu' in record['machine'] else 'cpu'}"
    out = HERE / "results" / f"{label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    for stage, r in results.items():
        rate, peak = r["tokens_per_s"], r["peak_memory_mb"]
        print(f"{stage:>7}: {rate:>10.0f} tokens/s  peak {peak:>8.0f} MB  ({r['steps']} steps)")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
