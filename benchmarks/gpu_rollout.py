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

STARTED = time.perf_counter()  # --deadline-s counts from here
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
    SHAPES,
    bandwidth,
    dschat_epoch,
    environment,
    hf_config,
    roofline,
    scrub,
    settings,
    slug,
)
from gpu_jobs import build_dir, child, log_event, run_job, subprocess_job, write_prompts  # noqa: E402
from gpu_plan import Case, plan, prompts_batch, setup_s, timeout_s  # noqa: E402


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
        self.data: dict[str, Any] = {
            "measurement": measurement,
            "environment": env,
            "command": command_line(args.argv, out),
            "settings": settings(args.dry),
            "random_init": True,
            "tokenizer": "kubealign tiny-opt (vocabulary 1024)",
            "cases": [],
        }

    def add(self, case: dict[str, Any]) -> None:
        self.data["cases"].append(case)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


class RunLog:
    """gpu-run-<label>.jsonl under --out, appended to (never rewritten): one line when this script starts,
    one per case when it ends (status, seconds, estimate), one from each child process when it starts.
    It shows what a records file cannot: a second pass over the same cases (the records are rewritten
    from zero), a child started twice, and how the estimates of gpu_plan compare with the GPU's times."""

    def __init__(self, out: Path, args: argparse.Namespace, env: dict[str, Any]):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"gpu-run-{args.label or slug(env, args.dry)}.jsonl"

    def __call__(self, **event: Any) -> None:
        log_event(str(self.path), **event)


class Budget:
    """The call's one deadline (--deadline-s from the start of this script; 0: none)."""

    def __init__(self, deadline_s: float, started: float | None = None):
        self.deadline_s, self.started = deadline_s, time.perf_counter() if started is None else started

    def left_s(self) -> float:
        return (self.deadline_s or float("inf")) - (time.perf_counter() - self.started)


def case_id(case: Case) -> str:
    return f"{case.measurement}:{case.fields.get('model')}:{case.name}"


def setup(cases: list[Case], work: Path, dry: bool) -> dict[str, str]:
    """The model dirs (and the prompt split) the planned cases read, built once per --work dir."""
    needed = {m for c in cases if c.spec is not None for m in c.models}
    dirs = {}
    for name in ("opt-1.3b", "llama-1.3b", "opt-350m"):
        if name in needed:
            dirs[name] = str(build_dir(name, "score" if name == "opt-350m" else "causal", work, dry))
    for name in sorted(n for n in needed if n.startswith("prompts")):
        # enough for every iteration twice over; the eval split one batch (the stage keeps at most 32 prompts)
        batch, iterations = prompts_batch(name, dry), settings(dry)["iteration"]["iterations"]
        dirs[name] = str(write_prompts(work, train=batch * iterations * 2, evaluation=batch, name=name))
    return dirs


def run(
    cases: list[Case],
    args: argparse.Namespace,
    work: Path,
    env: dict[str, Any],
    log: RunLog,
    budget: Budget | None = None,
) -> list[Path]:
    """The planned cases in order, each within the call's budget: a case whose estimate does not fit the
    time left is skipped; one that runs gets a timeout (gpu_plan.timeout_s). One record per measurement."""
    budget = budget or Budget(args.deadline_s)
    records: dict[str, Record] = {}
    for case in cases:
        if case.measurement not in records:
            records[case.measurement] = rec = Record(args.out, case.measurement, args, env)
            rec.data["plan"] = [
                {"case": c.name, "model": c.fields.get("model"), "estimate_s": c.estimate_s}
                for c in cases
                if c.measurement == case.measurement
            ]
            if case.measurement == "generation":
                rec.data["roofline"] = bandwidth(env)
            if case.measurement == "iteration":
                rec.data["dschat_epoch"] = DSCHAT_EPOCH
    started = time.perf_counter()
    dirs = setup(cases, work, args.dry)
    if env.get("gpu"):
        import torch

        torch.cuda.empty_cache()  # the model dirs were built here; the jobs run in children
    print(f"setup: {time.perf_counter() - started:.1f} s (estimated {setup_s(cases, run_sh=False):.0f} s)", flush=True)
    for case in cases:
        rec = records[case.measurement]
        base = {**case.fields, "case": case.name, "estimate_s": case.estimate_s}
        left = budget.left_s()
        if case.spec is None or case.estimate_s > left:
            status = case.status or f"skipped: time budget ({case.estimate_s:.0f} s estimated, {left:.0f} s left)"
            rec.add({**base, "status": status})
            log(event="case", case=case_id(case), status=status)
            continue
        limit = timeout_s(case, left)
        print(
            f"{case.measurement}: {case.fields.get('model')} {case.name} (estimated {case.estimate_s:.0f} s, "
            f"timeout {limit:.0f} s)",
            flush=True,
        )
        spec = {**case.spec, "case": case_id(case), "run_log": str(log.path)}
        spec.update({k: dirs[spec[k]] for k in ("actor", "critic", "prompts") if k in spec})
        started = time.perf_counter()
        if spec["job"] == "legacy":  # always a child: it runs in the side environment
            env_, side = legacy_env(args.legacy_site)
            result = {**subprocess_job(spec, limit, env_), "side_environment": side}
        else:
            result = run_job(spec, args.isolate, limit)
        seconds = time.perf_counter() - started
        for line in lines(case, result, rec, args.dry):
            rec.add({**base, "timeout_s": limit, "case_s": seconds, **line})
        log(event="case", case=case_id(case), status=result.get("status"), case_s=seconds, estimate_s=case.estimate_s)
    return [rec.path for rec in records.values()]


def legacy_env(site: str | None) -> tuple[dict[str, str], str]:
    """Path (d)'s environment: transformers 4.44 and its tokenizers / hub in front of the path."""
    env = dict(os.environ)
    if not site:
        return env, "none given: the child runs in this environment"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(site).resolve()), env.get("PYTHONPATH")) if p)
    return env, "--legacy-site (transformers 4.44 side environment)"


def lines(case: Case, result: dict[str, Any], rec: Record, dry: bool) -> list[dict[str, Any]]:
    """A job's result as record lines: one per measured batch (status ok, with the roofline), and a line
    with the status and error when the job did not finish; figures measured before a failure stay."""
    measured = result.pop("cases", None) or []
    status = result.get("status")
    if case.measurement == "iteration" and status == "ok":
        result["dschat_epoch"] = dschat_epoch(result["samples_per_s"], not dry)  # samples over time
    if case.measurement != "generation":
        return [result]
    shape = (DRY_SHAPES if dry else SHAPES)[case.fields["model"]]
    params = parameters_of(shape)
    kept = {k: v for k, v in result.items() if k not in ("status", "error", "where")}
    out = []
    for figures in measured:
        roofline(figures, shape, params, settings(dry), rec.data["roofline"]["used_Bps"])
        out.append({"parameters": params, **kept, "status": "ok", **figures})
    if status != "ok" or not measured:
        out.append({"parameters": params, **result})
    return out


def parameters_of(shape: dict[str, Any]) -> int:
    """Parameter count of a causal LM of this shape, without building it (meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config(shape)).parameters())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measurement", choices=("generation", "correctness", "iteration", "all"))
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results dir")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes: checks the harness, measures nothing")
    parser.add_argument("--arch", default="opt,llama", help="generation: comma-separated, of opt, llama")
    parser.add_argument(
        "--paths", default=",".join(GEN_PATHS), help="generation: comma-separated, of " + ",".join(GEN_PATHS)
    )
    parser.add_argument("--only", default="", help="comma-separated case names or globs (gpu_plan): run only these")
    parser.add_argument(
        "--legacy-site",
        default=os.environ.get("KUBEALIGN_LEGACY_SITE"),
        help="dir with transformers 4.44, tokenizers 0.19, huggingface-hub 0.x: path (d)",
    )
    parser.add_argument(
        "--iteration-path",
        choices=("he-plain", "engine"),
        default=None,
        help="iteration: force a rollout path (default: the preflight decides, as in a real run)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="the call's budget from this script's start: a case whose estimate does not fit "
        "what is left is skipped, one that runs is killed when it is spent (0: none)",
    )
    parser.add_argument("--work", type=Path, default=None, help="model dirs (built once, reused when present)")
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each case in its own process, with a timeout (default: on CUDA)",
    )
    parser.add_argument("--label", default=None, help="results file suffix (default: the GPU's name)")
    args = parser.parse_args(argv)
    args.argv = argv
    args.arch = [a for a in args.arch.split(",") if a]
    args.paths = [p for p in args.paths.split(",") if p]
    args.only = [p for p in args.only.split(",") if p]
    if bad := [a for a in args.arch if a not in ACTORS] + [p for p in args.paths if p not in GEN_PATHS]:
        parser.error(f"unknown --arch / --paths value(s): {', '.join(bad)}")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child(argv[1])
    args = parse(argv)
    for name in LAUNCHER_VARS:  # see gpu_core.LAUNCHER_VARS
        os.environ.pop(name, None)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available()
    if args.isolate is None:
        args.isolate = cuda
    env = environment()
    log = RunLog(args.out, args, env)
    cases = plan(args, cuda)
    if not cases:
        sys.exit(f"gpu_rollout.py: no case matches --only {','.join(args.only)} (case names: benchmarks/gpu_plan.py)")
    log(
        event="start",
        measurement=args.measurement,
        command=command_line(argv, args.out),
        cases=[case_id(c) for c in cases],
    )
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-rollout-")))
        work.mkdir(parents=True, exist_ok=True)
        paths = run(cases, args, work, env, log, Budget(args.deadline_s, STARTED))
    seconds = time.perf_counter() - STARTED
    log(event="end", measurement=args.measurement, seconds=seconds)
    print(f"{args.measurement}: {seconds:.1f} s, written to {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
