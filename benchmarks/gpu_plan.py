"""The plan of one GPU call of benchmarks/gpu_rollout.py: its cases, each with an estimated time and a
timeout, cheapest first, cut to the call's time budget. Pure (no torch): tests/test_gpu_harness.py checks
that every call docs/gpu.md lists fits CALL_BUDGET_S on a machine that was just started.

A case is one job in one process on a GPU (its own DeepSpeed state, peak memory and CUDA context: an
illegal memory access in one never reaches the next). A case whose estimate does not fit the time left is
skipped and says so; a case that runs is killed at its timeout and recorded as `timeout`, with what it had
measured by then.
"""

from __future__ import annotations

import argparse
import fnmatch
from dataclasses import dataclass, field
from typing import Any

from gpu_core import ACTORS, DRY_SHAPES, GEN_PATHS, LEGACY_VARIANTS, NEEDS_CUDA, SHAPES, settings

# What one call may plan: a device command runs at most 600 s; the plan leaves 120 s for what the estimates
# miss (the issue: "each call fits in 8 minutes on a machine that was just started").
CALL_BUDGET_S = 480.0
# A GPU session's device time, all of it (issue 43): the machine's start, every call, every idle wait. The
# headline calls (docs/gpu.md "The 15-minute plan") are planned into HEADLINE_BUDGET_S together, the first on
# a machine just started, the next warm (run.sh's wheels installed, the model dirs built): the start and the
# waits between calls take the rest, and what is left goes to the optional third call.
SESSION_BUDGET_S = 900.0
# The device tool's start of a bare machine, transfers included: measured 30 s and about 33 s on 2026-11-27
# (an H200: held_s minus the command's wall_s), written down as 180 before any GPU session; kept with margin.
MACHINE_START_S = 45.0
HEADLINE_BUDGET_S = 600.0
# A case is killed at this multiple of its estimate (or at the call's deadline, whichever comes first).
TIMEOUT_FACTOR = 2.0

# Estimated seconds on one H100 that was just started: nothing cached (no torch.compile / inductor cache,
# no model dirs), DeepSpeed's fused_adam and transformer_inference ops prebuilt and carried
# (benchmarks/gpu/ops.sh; a JIT build instead costs minutes the first time, and timeouts then cut it).
# Each includes its process's start (python, torch, transformers and DeepSpeed imports: ~15 s) and its
# model / engine builds. Shapes: OPT-1.3B (or the 1.3B Llama) in bf16, prompt 256, 256 new tokens, a
# warm-up plus 2 timed runs and 2 prefills per batch; correctness 3 PPO updates at batch 4, 32 + 32 tokens;
# iteration 4 ppo-stage iterations at the preset's batch 4, 256 + 256 tokens.
# First written without a GPU; every record keeps `estimate_s` beside the measured `case_s`. The first GPU
# run (2026-11-27, one H200, docs/gpu.md) measured hf-eager 52 s (60 estimated), kubealign-he-z2 57 (100),
# correctness kubealign-he-z2 96 (75), iteration z2-lora 138 (90) and z2-full over 106 (killed at the call's
# deadline, 90 estimated): those are the figures below (z2-full at z2-lora's plus its full-model optimizer).
# The cases not yet run are rescaled by their measured neighbour: the rollout cases (kubealign-engine-z2,
# -he-z3) as -he-z2 (x 0.57), correctness x 1.28, iteration at ZeRO 3 x 1.53; the HF compile and legacy
# cases keep the figures written without a GPU.
ESTIMATES_S: dict[str, dict[str, Any]] = {
    "generation": {
        # one process for both batches (16, then 64): HF eager ~20 ms a decode step, 3 x 256 steps a batch
        "hf-eager": 52,
        # one process per batch: transformers compiles the decode step (torch.compile, CUDA graphs) for the
        # full length and again for the 1-token prefill's cache size, from an empty cache
        "hf-static-compile": (200, 200),
        # one process for both batches: the four models of the ppo stage built by DeepSpeed, then kubealign's
        # rollout; ZeRO-3 gathers the partitioned weights for generation
        "kubealign-engine-z2": 57,
        "kubealign-he-z2": 57,
        "kubealign-he-z3": 86,
        # one process per batch size (DeepSpeed's inference workspace is sized at the first forward); the
        # smaller batch's process also trains 3 steps and checks greedy tokens (the legacy correctness)
        "legacy-he-injected-z2": (75, 55),
        "legacy-he-injected-z2-cuda-graph": (85, 65),
        "legacy-he-injected-z3": (95, 75),
    },
    "correctness": {
        "kubealign-engine-z2": 90,
        "kubealign-he-z2": 96,
        "kubealign-he-z2-lora": 102,
        "kubealign-he-z3": 128,
    },
    "iteration": {"z2-lora": 138, "z2-full": 150, "z3-lora": 199, "z3-full": 199},
}
# The fixed part of a call on a fresh machine: run.sh installing the carried wheels and checking that they
# and the prebuilt ops import; gpu_rollout.py's own start (imports, the environment, the bandwidth copy);
# each model dir (random weights saved as safetensors) and the prompt split, built once per machine.
# Measured on the H200 (2026-11-27): run.sh 23-24 s on a fresh machine, 10-13 s warm; gpu_rollout.py's start
# 3-4 s to its first line, then its setup 16 s with both OPT dirs to build, 10 s with none (the Llama dir and
# the prompt split: not measured apart).
SETUP_S = {"run.sh": 25, "process": 14, "opt-1.3b": 5, "opt-350m": 2, "llama-1.3b": 5, "prompts": 5}
# run.sh on a warm machine: the wheels are installed (its .installed marker), only the import checks run
RUN_SH_WARM_S = 13.0
# `run.sh tests` (pytest -m gpu: tests/stages/test_gpu_ppo.py after the module's split / sft / reward fixture):
# measured 40 s for its first three tests; the top-k test that replaced one runs four 1-iteration PPO runs
TESTS_S = 60.0
# `run.sh padding-free` (issue 62: real_lengths.py --quick at OPT-1.3B shape in bf16, not measured yet): the
# HH-trained BPE and the 1.3B model dir (about 25 s), then per stage an engine per mode from that dir (sft
# three, the others two: about 10 s each, 9 in all), 2 rounds of 1 step per mode, and the padded-vs-grouped
# difference check (a model load per stage). Peak: SFT's three engines, about 21 GB each in bf16 with AdamW.
PADDING_FREE_S = 180.0

# A case of one batch is named by the GPU's batch size (hf-static-compile-b16, ...), also in a dry run, where
# it runs at the dry batch of the same rank: `--only` then picks the same cases in both.
GPU_BATCHES = settings(False)["batches"]
CORRECTNESS = (
    ("kubealign-he-z2", "he-plain", 2, False),
    ("kubealign-he-z3", "he-plain", 3, False),
    ("kubealign-he-z2-lora", "he-plain", 2, True),
    ("kubealign-engine-z2", "engine", 2, False),
)
ITERATION = (("z2-lora", 2, True), ("z2-full", 2, False), ("z3-lora", 3, True), ("z3-full", 3, False))


@dataclass
class Case:
    """One job of a call. `spec` names models (opt-1.3b, opt-350m, ...) where the job reads a model dir:
    the runner puts the built dir in their place. spec None: not run, `status` says why."""

    measurement: str
    name: str  # unique within its measurement and model; what --only matches
    estimate_s: float
    fields: dict[str, Any]  # recorded on every line of this case
    spec: dict[str, Any] | None
    status: str | None = None
    models: tuple[str, ...] = field(default=())  # model dirs (and "prompts") the job reads


def estimate(measurement: str, path: str, rank: int | None = None) -> float:
    """The table's estimate; `rank` picks the batch (0: the smaller) of a per-batch entry."""
    value = ESTIMATES_S[measurement][path]
    return float(value[rank or 0] if isinstance(value, tuple) else value)


def generation_cases(args: argparse.Namespace, cuda: bool) -> list[Case]:
    s = settings(args.dry)
    shapes = DRY_SHAPES if args.dry else SHAPES
    cases = []
    for arch in args.arch:
        model = ACTORS[arch]
        base = {
            "model": model,
            "dtype": s["dtype"],
            "prompt_len": s["prompt_len"],
            "new_tokens": s["new_tokens"],
            "sampling": "temperature 1, top_k 0, top_p 1",
        }
        common = {
            "dtype": s["dtype"],
            "reps": s["reps"],
            "prompt_len": s["prompt_len"],
            "new_tokens": s["new_tokens"],
            "vocab": shapes[model]["vocab_size"],
        }
        for path in [p for p in GEN_PATHS if p in args.paths]:
            if path == "hf-eager":
                spec = {"job": "hf", "compiled": False, "actor": model, "batches": s["batches"], **common}
                cases.append(
                    Case(
                        "generation", path, estimate("generation", path), {**base, "path": path}, spec, models=(model,)
                    )
                )
            elif path == "hf-static-compile":
                for rank, batch in enumerate(s["batches"]):
                    spec = {"job": "hf", "compiled": True, "actor": model, "batches": [batch], **common}
                    case = Case(
                        "generation",
                        f"{path}-b{GPU_BATCHES[rank]}",
                        estimate("generation", path, rank),
                        {**base, "path": path},
                        spec if cuda else None,
                        models=(model,),
                    )
                    case.status = None if cuda else NEEDS_CUDA
                    cases.append(case)
            elif path.startswith("kubealign-"):
                spec = {
                    "job": "rollout",
                    "path": "engine" if "engine" in path else "he-plain",
                    "zero": int(path[-1]),
                    "batch": max(s["batches"]),
                    "batches": s["batches"],
                    "actor": model,
                    "critic": "opt-350m",
                    **common,
                }
                cases.append(
                    Case(
                        "generation",
                        path,
                        estimate("generation", path),
                        {**base, "path": path},
                        spec,
                        models=(model, "opt-350m"),
                    )
                )
            else:
                cases += legacy_cases(args, cuda, base, shapes[model])
    return cases


def legacy_cases(args: argparse.Namespace, cuda: bool, base: dict[str, Any], shape: dict[str, Any]) -> list[Case]:
    """Path (d): one process per variant AND batch size. DeepSpeed's inference workspace is sized at the
    engine's first forward and never grows: batch 64 after batch 16 on one engine overruns it. On a CPU
    only the first case runs (it shows that the side environment imports); the others need CUDA."""
    s = settings(args.dry)
    cases = []
    for variant, zero, graphs in LEGACY_VARIANTS:
        path = f"legacy-{variant}"
        for rank, batch in enumerate(s["batches"]):
            spec = {
                "job": "legacy",
                "shape": shape,
                "zero": zero,
                "cuda_graph": graphs,
                "batches": [batch],
                "reps": s["reps"],
                "prompt_len": s["prompt_len"],
                "new_tokens": s["new_tokens"],
                "correctness": s["correctness"] if rank == 0 else None,
            }
            runs = cuda or not cases
            name = f"{path}-b{GPU_BATCHES[rank]}"
            case = Case(
                "generation",
                name,
                estimate("generation", path, rank),
                {**base, "path": path},
                spec if runs else None,
                None if runs else NEEDS_CUDA,
            )
            cases.append(case)
    return cases


def correctness_cases(args: argparse.Namespace) -> list[Case]:
    s = settings(args.dry)
    c = s["correctness"]
    vocab = (DRY_SHAPES if args.dry else SHAPES)["opt-1.3b"]["vocab_size"]
    cases = []
    for name, path, zero, lora in CORRECTNESS:
        fields = {"path": name, "model": "opt-1.3b", "critic": "opt-350m", "dtype": s["dtype"], **c}
        spec = {
            "job": "correctness",
            "path": path,
            "zero": zero,
            "lora": lora,
            "dtype": s["dtype"],
            "batch": c["batch"],
            "prompt_len": c["prompt_len"],
            "new_tokens": c["new_tokens"],
            "updates": c["updates"],
            "vocab": vocab,
            "actor": "opt-1.3b",
            "critic": "opt-350m",
        }
        cases.append(
            Case("correctness", name, estimate("correctness", name), fields, spec, models=("opt-1.3b", "opt-350m"))
        )
    return cases


def iteration_cases(args: argparse.Namespace) -> list[Case]:
    it = settings(args.dry)["iteration"]
    batch = it["batch"] or 4  # the preset's generation_batch_size (4) unless dry
    common = [
        "tracking.enabled=false",
        f"ppo.num_iterations={it['iterations']}",
        "ppo.sample_every_iterations=0",
        "ppo.save_every_iterations=0",
        f"ppo.max_prompt_len={it['prompt_len']}",
        f"ppo.max_new_tokens={it['new_tokens']}",
        f"ppo.generation_batch_size={batch}",
        f"ppo.micro_batch_size={batch}",
    ]
    if args.dry:  # no fp16 on a CPU; a LoRA rank that fits width 64
        common += ["ppo.dtype=fp32", "ppo.actor_lora.r=8", "ppo.actor_lora.alpha=8"]
    cases = []
    for name, zero, lora in ITERATION:
        overrides = [*common, f"ppo.actor_zero_stage={zero}", f"ppo.critic_zero_stage={zero}"]
        overrides += [] if lora else ["ppo.actor_lora.r=0", "ppo.actor_lora.only_lora=false"]
        fields = {"variant": name, "preset": "configs/opt-1.3b-1gpu.yaml", "overrides": overrides}
        spec = {
            "job": "iteration",
            "overrides": overrides,
            "prompts": "prompts",
            "actor": "opt-1.3b",
            "critic": "opt-350m",
            "path": args.iteration_path,
        }
        cases.append(
            Case(
                "iteration", name, estimate("iteration", name), fields, spec, models=("opt-1.3b", "opt-350m", "prompts")
            )
        )
    return cases


def plan(args: argparse.Namespace, cuda: bool) -> list[Case]:
    """Every case the call asks for (--arch, --paths, --only), cheapest first (ties keep the order above)."""
    steps = ("generation", "correctness", "iteration") if args.measurement == "all" else (args.measurement,)
    cases: list[Case] = []
    for step in steps:
        if step == "generation":
            cases += generation_cases(args, cuda)
        elif step == "correctness":
            cases += correctness_cases(args)
        else:
            cases += iteration_cases(args)
    if args.only:
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, pattern) for pattern in args.only)]
    return sorted(cases, key=lambda c: c.estimate_s)


def setup_s(cases: list[Case], run_sh: bool = True, built: frozenset[str] = frozenset()) -> float:
    """The call's fixed part: run.sh's installs and checks (fresh machine: nothing `built`), the process, the
    model dirs not built by an earlier call on the same machine."""
    needed = {m for c in cases if c.spec is not None for m in c.models} - built
    run = (RUN_SH_WARM_S if built else SETUP_S["run.sh"]) if run_sh else 0.0
    return run + SETUP_S["process"] + sum(SETUP_S[m] for m in needed)


def call_estimate(cases: list[Case], built: frozenset[str] = frozenset()) -> float:
    """What a call takes by these estimates: setup plus every case that runs. built: the model dirs earlier
    calls made on this (then warm) machine; empty = a machine just started."""
    return setup_s(cases, built=built) + sum(c.estimate_s for c in cases if c.spec is not None)


def models_built(cases: list[Case]) -> frozenset[str]:
    return frozenset(m for c in cases if c.spec is not None for m in c.models)


def timeout_s(case: Case, left_s: float) -> float:
    return min(TIMEOUT_FACTOR * case.estimate_s, left_s)
