"""GPU proof of the rollout: generation speed of each rollout path against the decode roofline, the
correctness of each path that trains, and one full PPO iteration at DeepSpeed-Chat's single-GPU shape.
Each sub-command writes one JSON under --out (default benchmarks/results/) with the GPU, driver, library
versions and the command that produced it. See docs/gpu.md for how a GPU session runs it.

  python benchmarks/gpu_rollout.py generation   # 1. tokens/s, ms per decode step per path; batch 16 and 64
  python benchmarks/gpu_rollout.py correctness  # 2. 3 PPO updates, then greedy rollout == HF eager; ratio 1, KL 0
  python benchmarks/gpu_rollout.py iteration    # 3. the ppo stage at opt-1.3b-1gpu's shape: samples/s, split, memory
  python benchmarks/gpu_rollout.py all --dry    # all three on CPU at tiny shapes (2 layers, width 64), in seconds

Models are random-initialised from config at the real shapes (OPT-1.3B actor, OPT-350M critic/reward, a
Llama of about 1.3B without GQA); nothing is downloaded. The tokenizer is the repo's tiny one (vocabulary
1024, inside every model's vocabulary); generation prompts are ids drawn at random from the model's
vocabulary. Random weights are fine for speed (the work per token does not depend on the values); for
correctness they make near-ties likely, so a greedy mismatch is reported with the reference's top-2 logit
margin at that position. Paths that need CUDA are recorded as "skipped: needs CUDA" on a CPU, never faked.

Path (d), DeepSpeed's injected inference kernels, needs transformers <= 4.48: it runs in a side
environment (--legacy-site DIR: transformers 4.44.2, tokenizers 0.19, huggingface-hub 0.x, put in front of
PYTHONPATH) as a subprocess of this script; an import or build failure there is recorded, not raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(HERE), str(REPO)):  # gpu_core / gpu_jobs beside this file; kubealign from this checkout
    if path not in sys.path:
        sys.path.insert(1, path)

from gpu_core import (  # noqa: E402
    ACTORS,
    DRY_SHAPES,
    DSCHAT_EPOCH,
    GEN_PATHS,
    LAUNCHER_VARS,
    LEGACY_VARIANTS,
    NEEDS_CUDA,
    SHAPES,
    SPECIAL,
    bandwidth,
    dschat_epoch,
    environment,
    failure,
    hf_config,
    measure,
    random_prompts,
    roofline,
    scrub,
    settings,
    slug,
)
from gpu_jobs import build_dir, child, parameters, run_job, subprocess_job, write_prompts  # noqa: E402


def command_line(argv: list[str], out: Path) -> str:
    """The command as typed, with --out shown as $OUT-like placeholder when it lies outside the repo."""
    shown = []
    for arg in argv:
        path = Path(arg)
        if path.is_absolute() and path.resolve() == out.resolve():
            arg = str(out.relative_to(REPO)) if out.resolve().is_relative_to(REPO) else "$OUT"
        shown.append(scrub(arg))
    return shlex.join(["python3", "benchmarks/gpu_rollout.py", *shown])


class Record:
    """One measurement's JSON, rewritten after every case: a run killed at its time limit keeps what it had."""

    def __init__(self, out: Path, measurement: str, args: argparse.Namespace, env: dict[str, Any]):
        self.path = out / f"gpu-{measurement}-{args.label or slug(env, args.dry)}.json"
        self.started = self.last = time.perf_counter()
        self.data: dict[str, Any] = {"measurement": measurement, "environment": env,
                                     "command": command_line(args.argv, out), "settings": settings(args.dry),
                                     "random_init": True, "tokenizer": "kubealign tiny-opt (vocabulary 1024)",
                                     "cases": []}  # fmt: skip
        self.deadline = args.deadline_s

    def left_s(self) -> float:
        return (self.deadline or 1e9) - (time.perf_counter() - self.started)

    def add(self, case: dict[str, Any]) -> None:
        now = time.perf_counter()
        self.data["cases"].append({**case, "case_s": now - self.last})  # since the previous case
        self.last = now
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def hf_generate(directory: Path, dtype: str, compiled: bool) -> Any:
    """HF generate on one model: eager, or with a static cache (transformers then compiles the decode step
    with torch.compile, mode reduce-overhead: CUDA graphs)."""
    import torch
    from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model = model.to(device).eval()
    extra = {"cache_implementation": "static", "compile_config": CompileConfig()} if compiled else {}

    def for_batch(ids: Any, mask: Any) -> Any:
        def once(n: int) -> Any:
            settings_ = GenerationConfig(
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                max_new_tokens=n,
                min_new_tokens=n,
                **{f"{k}_token_id": v for k, v in SPECIAL.items()},
            )
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=mask, generation_config=settings_, **extra)

        return once

    return model, for_batch


def generation(args: argparse.Namespace, work: Path, env: dict[str, Any]) -> Path:
    """Item 1: every path x architecture x batch, as a fraction of the decode roofline."""
    import gc

    import torch

    s = settings(args.dry)
    rec = Record(args.out, "generation", args, env)
    bw = bandwidth(env)
    rec.data["roofline"] = bw
    critic = build_dir("opt-350m", "score", work, args.dry)
    for arch in args.arch:
        name = ACTORS[arch]
        shape = (DRY_SHAPES if args.dry else SHAPES)[name]
        actor = build_dir(name, "causal", work, args.dry)
        params = parameters(actor)
        base = {"model": name, "parameters": params, "dtype": s["dtype"], "prompt_len": s["prompt_len"],
                "new_tokens": s["new_tokens"], "sampling": "temperature 1, top_k 0, top_p 1"}  # fmt: skip
        for path in [p for p in GEN_PATHS if p in args.paths]:
            if rec.left_s() < 30:
                rec.add({**base, "path": path, "status": "skipped: time budget"})
                continue
            print(f"generation: {name} {path}", flush=True)
            if path == "legacy":
                for case in legacy(args, s, shape, rec):
                    rec.add({**base, **case})
                continue
            if path == "hf-static-compile" and not torch.cuda.is_available():
                rec.add({**base, "path": path, "status": NEEDS_CUDA})
                continue
            if path.startswith("hf-"):
                try:
                    model, for_batch = hf_generate(actor, s["dtype"], compiled=path == "hf-static-compile")
                    for batch in s["batches"]:
                        ids, mask = random_prompts(batch, s["prompt_len"], shape["vocab_size"], model.device)
                        case = measure(for_batch(ids, mask), batch, s["prompt_len"], s["new_tokens"], s["reps"])
                        roofline(case, shape, params, s, bw["used_Bps"])
                        rec.add({**base, "path": path, "status": "ok", **case})
                    del model, for_batch
                except Exception as exc:
                    rec.add({**base, "path": path, **failure(exc)})
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            zero = int(path[-1])
            spec = {"job": "rollout", "path": "engine" if "engine" in path else "he-plain", "zero": zero,
                    "dtype": s["dtype"], "batch": max(s["batches"]), "batches": s["batches"], "reps": s["reps"],
                    "prompt_len": s["prompt_len"], "new_tokens": s["new_tokens"], "vocab": shape["vocab_size"],
                    "actor": str(actor), "critic": str(critic)}  # fmt: skip
            result = run_job(spec, args.isolate, rec.left_s())
            cases = result.pop("cases", None)
            if result.get("status") != "ok" or not cases:
                rec.add({**base, "path": path, **result})
                continue
            for case in cases:
                roofline(case, shape, params, s, bw["used_Bps"])
                rec.add({**base, "path": path, **result, **case})
    return rec.path


def legacy(args: argparse.Namespace, s: dict[str, Any], shape: dict[str, Any], rec: Record) -> list[dict[str, Any]]:
    """Path (d) in the side environment, one subprocess per variant; errors become cases."""
    site = args.legacy_site
    env = dict(os.environ)
    side = "none given: the child runs in this environment"
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(site).resolve()), env.get("PYTHONPATH")) if p)
        side = "--legacy-site (transformers 4.44 side environment)"
    cases = []
    for variant, zero, graphs in LEGACY_VARIANTS:
        spec = {"job": "legacy", "shape": shape, "zero": zero, "cuda_graph": graphs, "batches": s["batches"],
                "reps": s["reps"], "prompt_len": s["prompt_len"], "new_tokens": s["new_tokens"],
                "correctness": s["correctness"]}  # fmt: skip
        if rec.left_s() < 60:
            cases.append({"path": f"legacy-{variant}", "status": "skipped: time budget"})
            continue
        result = subprocess_job(spec, rec.left_s(), env)
        result["side_environment"] = side
        measured = result.pop("cases", None) or [{}]
        for case in measured:
            if case:
                roofline(case, shape, parameters_of(shape), s, rec.data["roofline"]["used_Bps"])
            cases.append({"path": f"legacy-{variant}", **result, **case})
        if str(result.get("status", "")).startswith(NEEDS_CUDA) or "transformers" not in result:
            break  # no CUDA, or the side environment does not import: the other variants would say the same
    return cases


def parameters_of(shape: dict[str, Any]) -> int:
    """Parameter count of a causal LM of this shape, without building it (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(shape)).parameters())


def correctness(args: argparse.Namespace, work: Path, env: dict[str, Any]) -> Path:
    """Item 2 for each kubealign path that trains (the legacy injected path reports its own in `generation`)."""
    s = settings(args.dry)
    c = s["correctness"]
    rec = Record(args.out, "correctness", args, env)
    actor, critic = build_dir("opt-1.3b", "causal", work, args.dry), build_dir("opt-350m", "score", work, args.dry)
    vocab = (DRY_SHAPES if args.dry else SHAPES)["opt-1.3b"]["vocab_size"]
    variants = (("he-plain", 2, False), ("he-plain", 3, False), ("he-plain", 2, True), ("engine", 2, False))
    for path, zero, lora in variants:
        name = f"kubealign-{'he' if path == 'he-plain' else 'engine'}-z{zero}{'-lora' if lora else ''}"
        case = {"path": name, "model": "opt-1.3b", "critic": "opt-350m", "dtype": s["dtype"], **c}
        if rec.left_s() < 60:
            rec.add({**case, "status": "skipped: time budget"})
            continue
        print(f"correctness: {name}", flush=True)
        spec = {"job": "correctness", "path": path, "zero": zero, "lora": lora, "dtype": s["dtype"],
                "batch": c["batch"], "prompt_len": c["prompt_len"], "new_tokens": c["new_tokens"],
                "updates": c["updates"], "vocab": vocab, "actor": str(actor), "critic": str(critic)}  # fmt: skip
        rec.add({**case, **run_job(spec, args.isolate, rec.left_s())})
    return rec.path


def iteration(args: argparse.Namespace, work: Path, env: dict[str, Any]) -> Path:
    """Item 3: opt-1.3b-1gpu's shape (actor with and without LoRA, ZeRO 2 and 3), DeepSpeed-Chat's epoch."""
    s = settings(args.dry)
    it = s["iteration"]
    rec = Record(args.out, "iteration", args, env)
    rec.data["dschat_epoch"] = DSCHAT_EPOCH
    actor, critic = build_dir("opt-1.3b", "causal", work, args.dry), build_dir("opt-350m", "score", work, args.dry)
    batch = it["batch"] or 4  # the preset's generation_batch_size (4) unless dry
    prompts = write_prompts(work, train=batch * it["iterations"] * 2, evaluation=batch)
    common = ["tracking.enabled=false", f"ppo.num_iterations={it['iterations']}", "ppo.sample_every_iterations=0",
              "ppo.save_every_iterations=0", f"ppo.max_prompt_len={it['prompt_len']}",
              f"ppo.max_new_tokens={it['new_tokens']}", f"ppo.generation_batch_size={batch}",
              f"ppo.micro_batch_size={batch}"]  # fmt: skip
    if args.dry:  # no fp16 on a CPU; a LoRA rank that fits width 64
        common += ["ppo.dtype=fp32", "ppo.actor_lora.r=8", "ppo.actor_lora.alpha=8"]
    for zero in (2, 3):
        for lora in (True, False):
            name = f"z{zero}-{'lora' if lora else 'full'}"
            overrides = [*common, f"ppo.actor_zero_stage={zero}", f"ppo.critic_zero_stage={zero}"]
            overrides += [] if lora else ["ppo.actor_lora.r=0", "ppo.actor_lora.only_lora=false"]
            case = {"variant": name, "preset": "configs/opt-1.3b-1gpu.yaml", "overrides": overrides}
            if rec.left_s() < 90:
                rec.add({**case, "status": "skipped: time budget"})
                continue
            print(f"iteration: {name}", flush=True)
            spec = {"job": "iteration", "overrides": overrides, "prompts": str(prompts), "actor": str(actor),
                    "critic": str(critic), "path": args.iteration_path}  # fmt: skip
            result = run_job(spec, args.isolate, rec.left_s())
            if result.get("status") == "ok":
                result["dschat_epoch"] = dschat_epoch(result["per_iteration_mean"]["samples_per_s"], not args.dry)
            rec.add({**case, **result})
    return rec.path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measurement", choices=("generation", "correctness", "iteration", "all"))
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results dir")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes: checks the harness, measures nothing")
    parser.add_argument("--arch", default="opt,llama", help="generation: comma-separated, of opt, llama")
    parser.add_argument(
        "--paths", default=",".join(GEN_PATHS), help="generation: comma-separated, of " + ",".join(GEN_PATHS)
    )
    parser.add_argument("--legacy-site", default=os.environ.get("KUBEALIGN_LEGACY_SITE"),
                        help="dir with transformers 4.44, tokenizers 0.19, huggingface-hub 0.x: path (d)")  # fmt: skip
    parser.add_argument(
        "--iteration-path",
        choices=("he-plain", "engine"),
        default=None,
        help="iteration: force a rollout path (default: the preflight decides, as in a real run)",
    )
    parser.add_argument("--deadline-s", type=float, default=0.0, help="skip cases once this much time is spent")
    parser.add_argument("--work", type=Path, default=None, help="model dirs (built once, reused when present)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each DeepSpeed build in its own process (default: on CUDA)")  # fmt: skip
    parser.add_argument("--label", default=None, help="results file suffix (default: the GPU's name)")
    args = parser.parse_args(argv)
    args.argv = argv
    args.arch = [a for a in args.arch.split(",") if a]
    args.paths = [p for p in args.paths.split(",") if p]
    if bad := [a for a in args.arch if a not in ACTORS] + [p for p in args.paths if p not in GEN_PATHS]:
        parser.error(f"unknown --arch / --paths value(s): {', '.join(bad)}")
    for name in LAUNCHER_VARS:  # see gpu_core.LAUNCHER_VARS
        os.environ.pop(name, None)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.isolate is None:
        args.isolate = torch.cuda.is_available()
    env = environment()
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-rollout-")))
        work.mkdir(parents=True, exist_ok=True)
        steps = [generation, correctness, iteration] if args.measurement == "all" else [globals()[args.measurement]]
        for step in steps:
            started = time.perf_counter()
            path = step(args, work, env)
            print(f"{step.__name__}: {time.perf_counter() - started:.1f} s, written to {path}", flush=True)


if __name__ == "__main__":
    main()


if __name__ == "__main__":
    main()
