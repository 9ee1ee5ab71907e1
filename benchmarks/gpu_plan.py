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
# Between two calls of a session's plan the machine waits, warm, for the next call (and after the last for the
# give-back): the reply read and the next call made at once, written down as 10 s each.
CALL_GAP_S = 10.0
# A case is killed at this multiple of its estimate (or at the call's deadline, whichever comes first).
TIMEOUT_FACTOR = 2.0

# Estimated seconds on one H100 that was just started: nothing cached (no torch.compile / inductor cache,
# no model dirs), DeepSpeed's fused_adam and transformer_inference ops prebuilt and carried
# (benchmarks/gpu/ops.sh; a JIT build instead costs minutes the first time, and timeouts then cut it).
# Each includes its process's start (python, torch, transformers and DeepSpeed imports: ~15 s) and its
# model / engine builds. Shapes: OPT-1.3B (or the 1.3B Llama) in bf16, prompt 256, 256 new tokens, a
# warm-up plus 2 timed runs and 2 prefills per batch; correctness 3 PPO updates at batch 4, 32 + 32 tokens;
# iteration 4 ppo-stage iterations at the case's generation batch (the preset's 4 unless named), 256 + 256 tokens.
# First written without a GPU; every record keeps `estimate_s` beside the measured `case_s`. The first GPU
# run (2026-11-27, one H200, docs/gpu.md) measured hf-eager 52 s (60 estimated), kubealign-he-z2 57 (100),
# correctness kubealign-he-z2 96 (75), iteration z2-lora 138 (90) and z2-full over 106 (killed at the call's
# deadline, 90 estimated); the second (2026-11-28) z2-full 131 (150). The cases not yet run are rescaled by their
# measured neighbour: the rollout cases (kubealign-engine-z2, -he-z3) as -he-z2 (x 0.57), correctness x 1.28;
# the HF compile and legacy cases keep the figures written without a GPU.
# Issue 74 (2026-12, no GPU; the scaling is written out so that a GPU run can correct each step):
# * kubealign rollout paths: + 8 s for the check against HF eager (gpu_jobs.against_hf_eager at batch 16: a
#   sampled rollout, one full forward, one greedy rollout and HF eager's greedy generation, 256 steps each at
#   about 10 ms a step eager); -he-z3 + 14 (its eager steps gather ZeRO-3 shards).
# * kubealign-compiled-z2: -he-z2's 57 less its eager decoding (5 runs a batch x 2.6 s x 2 batches, 26 s) plus
#   two compilations of the decode step (COMPILE_S: batch 16, then 64 recompiles), its compiled runs (~10 s)
#   and the check (8 s): 57 - 26 + 70 + 50 + 10 + 8 = 169, written 175.
# * iteration: the measured case times less what gpu_jobs.iterations_only leaves out: the export (case_s less
#   the stage's wall time less ~15 s of process start: 138 - 49 - 15 = 74 for z2-lora, 131 - 45 - 15 = 71 for
#   z2-full; ITERATION_EXPORT_S = 60 taken, leaving margin) and the two evaluations (one rollout each at the
#   preset's batch 4: 2 x 3.3 s, written 7): z2-lora 138 - 67 = 71, z2-full 150 - 67 = 83, ZeRO 3 199 - 67 = 132.
# * a larger generation batch (micro batch kept at the preset's 4): 4 iterations of generation + experience +
#   training, scaled from z2-lora's measured means (3.24 s generation at batch 4 with 256 decode steps, 0.07 s
#   experience and 0.31 s training per 4 samples) with the decode step from the generation table (about the
#   same ms at batch 16, +17 % at 64): an iteration 3.6 s at gb 4, 4.9 s at gb 16 (3.4 + 0.28 + 1.25), 10.1 s
#   at gb 64 (4.0 + 1.1 + 5.0); gb16 71 + 4 x 1.3 = 76, written 78; gb64 71 + 4 x 6.5 = 97, written 98.
# * the compiled engine in the iteration: the case's hf figure plus one compilation per batch shape (70 s, the
#   evaluation's shapes left out) less its decode time saved (5 x 256 steps at ~10 ms against ~3 ms:
#   DeepSpeed PR #8271 measured OPT-1.3B graph-captured at 2.8 ms a step): gb16 78 + 70 - 10 = 138, gb64
#   98 + 70 - 12 = 156, written 158.
ESTIMATES_S: dict[str, dict[str, Any]] = {
    "generation": {
        # one process for both batches (16, then 64): HF eager ~20 ms a decode step, 3 x 256 steps a batch
        "hf-eager": 52,
        # one process per batch: transformers compiles the decode step (torch.compile, CUDA graphs) for the
        # full length and again for the 1-token prefill's cache size, from an empty cache
        "hf-static-compile": (200, 200),
        # one process for both batches: the four models of the ppo stage built by DeepSpeed, then kubealign's
        # rollout; ZeRO-3 gathers the partitioned weights for generation; then the check against HF eager
        "kubealign-engine-z2": 65,
        "kubealign-he-z2": 65,
        "kubealign-compiled-z2": 175,
        "kubealign-he-z3": 100,
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
    "iteration": {
        "z2-lora": 71,
        "z2-full": 83,
        "z3-lora": 132,
        "z3-full": 132,
        "z2-lora-gb16": 78,
        "z2-lora-gb64": 98,
        "z2-lora-compiled-gb16": 138,
        "z2-lora-compiled-gb64": 158,
    },
}
# The scaling's inputs above, kept as names (docs/gpu.md cites them): one torch.compile of OPT-1.3B's decode step
# with CUDA graphs from an empty cache, 16 CPU cores (not measured: transformers' static-cache compile of 1-2B
# models takes about a minute), and what the export of the trained models took in a measured iteration case.
COMPILE_S = 70.0
ITERATION_EXPORT_S = 60.0
# The fixed part of a call on a fresh machine: run.sh installing the carried wheels and checking that they
# and the prebuilt ops import; gpu_rollout.py's own start (imports, the environment, the bandwidth copy);
# each model dir (random weights saved as safetensors) and the prompt split, built once per machine.
# Measured on the H200 (2026-11-27): run.sh 23-24 s on a fresh machine, 10-13 s warm; gpu_rollout.py's start
# 3-4 s to its first line, then its setup 16 s with both OPT dirs to build, 10 s with none (the Llama dir and
# the prompt split: not measured apart).
# One prompt split per generation batch (gpu_jobs.write_prompts: its eval split the batch's size, so that the
# stage's evaluation batch is the training one): "prompts" for the preset's 4, "prompts-gb16", "prompts-gb64".
SETUP_S = {
    "run.sh": 25,
    "process": 14,
    "opt-1.3b": 5,
    "opt-350m": 2,
    "llama-1.3b": 5,
    "prompts": 5,
    "prompts-gb16": 5,
    "prompts-gb64": 5,
}
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
# name, actor ZeRO stage, LoRA actor, generation batch on a GPU, ppo.rollout.engine
ITERATION = (
    ("z2-lora", 2, True, 4, "hf"),
    ("z2-full", 2, False, 4, "hf"),
    ("z3-lora", 3, True, 4, "hf"),
    ("z3-full", 3, False, 4, "hf"),
    ("z2-lora-gb16", 2, True, 16, "hf"),
    ("z2-lora-gb64", 2, True, 64, "hf"),
    ("z2-lora-compiled-gb16", 2, True, 16, "compiled"),
    ("z2-lora-compiled-gb64", 2, True, 64, "compiled"),
)
# A generation batch of a GPU run and the one a dry run takes for it (at tiny shapes on a CPU): the same cases.
DRY_GENERATION_BATCH = {4: 2, 16: 4, 64: 8}


def prompts_name(generation_batch: int) -> str:
    """The prompt split a case at this (GPU) generation batch reads: SETUP_S's keys, built once per machine."""
    return "prompts" if generation_batch == 4 else f"prompts-gb{generation_batch}"


def prompts_batch(name: str, dry: bool) -> int:
    """The generation batch of a prompt split named by prompts_name, on a GPU or in a dry run."""
    batch = 4 if name == "prompts" else int(name.removeprefix("prompts-gb"))
    return DRY_GENERATION_BATCH[batch] if dry else batch


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
                    "engine": "compiled" if "compiled" in path else "hf",
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
    micro = it["batch"] or 4  # the preset's micro_batch_size (4) unless dry
    common = [
        "tracking.enabled=false",
        f"ppo.num_iterations={it['iterations']}",
        "ppo.sample_every_iterations=0",
        "ppo.save_every_iterations=0",
        f"ppo.max_prompt_len={it['prompt_len']}",
        f"ppo.max_new_tokens={it['new_tokens']}",
        f"ppo.micro_batch_size={micro}",
    ]
    if args.dry:  # no fp16 on a CPU; a LoRA rank that fits width 64
        common += ["ppo.dtype=fp32", "ppo.actor_lora.r=8", "ppo.actor_lora.alpha=8"]
    cases = []
    for name, zero, lora, gpu_batch, engine in ITERATION:
        batch = DRY_GENERATION_BATCH[gpu_batch] if args.dry else gpu_batch
        overrides = [
            *common,
            f"ppo.generation_batch_size={batch}",
            f"ppo.rollout.engine={engine}",  # pinned: auto picks the compiled engine on a GPU
            f"ppo.actor_zero_stage={zero}",
            f"ppo.critic_zero_stage={zero}",
        ]
        overrides += [] if lora else ["ppo.actor_lora.r=0", "ppo.actor_lora.only_lora=false"]
        fields = {"variant": name, "preset": "configs/opt-1.3b-1gpu.yaml", "overrides": overrides}
        prompts = prompts_name(gpu_batch)
        spec = {
            "job": "iteration",
            "overrides": overrides,
            "prompts": prompts,
            "actor": "opt-1.3b",
            "critic": "opt-350m",
            "path": args.iteration_path,
        }
        cases.append(
            Case("iteration", name, estimate("iteration", name), fields, spec, models=("opt-1.3b", "opt-350m", prompts))
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
