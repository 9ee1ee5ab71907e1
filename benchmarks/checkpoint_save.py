"""How long one training checkpoint takes to save: what a pod's grace period (SIGTERM -> SIGKILL) must hold.

Builds a randomly initialised model of a real OPT shape (no download), wraps it in the DeepSpeed engine the
sft stage uses (AdamW, fp32 on CPU; fp16/bf16 on a GPU), takes one optimizer step so the optimizer state
exists, then times kubealign's whole save path (training/loop._save): DeepSpeed's save_checkpoint, the
sha256 manifest (`seal`, which reads every byte back) and the commit of `latest`. It reports bytes written,
seconds per part and MB/s, so the save of a larger model on the same storage can be estimated as
bytes / rate. Results go to benchmarks/results/<label>.json with the machine.

  python benchmarks/checkpoint_save.py                       # opt-350m shape, checkpoints in a temp dir
  python benchmarks/checkpoint_save.py --shape opt-1.3b --dir /mnt/pvc/bench   # on the storage that counts
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from train_throughput import SHAPES, build_shaped, machine  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(shape: str, where: Path) -> dict:
    import torch

    from kubealign.config import load_config
    from kubealign.models import loading
    from kubealign.training import checkpoints, distributed, engine, loop

    model_dir = build_shaped(shape, where / "model")
    cuda = torch.cuda.is_available()
    cfg = load_config(None, ["tracking.enabled=false", f"sft.dtype={'bf16' if cuda else 'fp32'}"]).sft
    distributed.init()
    model = loading.load_causal_lm(str(model_dir), dtype=loading.torch_dtype(cfg.dtype))
    ds = engine.create(model, cfg, engine.ds_config(cfg, 1, cuda), total_steps=10)
    ids = torch.randint(0, 50000, (1, 64), device=ds.device)
    ds.backward(ds(input_ids=ids, labels=ids).loss)
    ds.step()
    task = SimpleNamespace(checkpoint_dir=where / "ckpt", name="sft")
    times: dict[str, float] = {}
    original_seal = checkpoints.seal

    def timed_seal(save_dir: Path, tag: str) -> None:
        times["save_checkpoint_s"] = time.perf_counter() - start
        sealed = time.perf_counter()
        original_seal(save_dir, tag)
        times["seal_sha256_s"] = time.perf_counter() - sealed

    checkpoints.seal = timed_seal
    start = time.perf_counter()
    loop._save(ds, task, {"step": 1, "epoch": 0, "batch": 1})
    times["total_s"] = time.perf_counter() - start
    checkpoints.seal = original_seal
    written = directory_bytes(task.checkpoint_dir)
    params = sum(p.numel() for p in model.parameters())
    return {
        "shape": shape,
        "parameters": params,
        "dtype": cfg.dtype,
        "bytes": written,
        "bytes_per_parameter": written / params,
        **times,
        "mb_per_s": written / 2**20 / times["total_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="opt-350m")
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--label", help="results file name (default: checkpoint-save-SHAPE-cpu|gpu)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = measure(args.shape, Path(tmp))
    record = {"result": result, "machine": machine()}
    label = args.label or f"checkpoint-save-{args.shape}-{'gpu' if 'gpu' in record['machine'] else 'cpu'}"
    out = HERE / "results" / f"{label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    r = result
    size = f"{r['bytes'] / 2**30:.2f} GiB ({r['bytes_per_parameter']:.1f} B/param)"
    parts = f"save {r['save_checkpoint_s']:.1f} s, sha256 {r['seal_sha256_s']:.1f} s"
    print(f"{r['shape']}: {size} in {r['total_s']:.1f} s ({parts}): {r['mb_per_s']:.0f} MB/s")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
