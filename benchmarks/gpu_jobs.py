"""The jobs of benchmarks/gpu_rollout.py that build DeepSpeed engines, each run in a fresh process on a GPU
(its own DeepSpeed state and peak memory): kubealign's rollout (path c) and its check against HF eager, the
correctness check (item 2), the ppo stage's iteration (item 3); the injected kernels (path d) are gpu_legacy's."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_core import (
    DRY_SHAPES,
    REPO,
    SHAPES,
    SPECIAL,
    compare,
    failure,
    greedy,
    hf_config,
    iteration_figures,
    logprob_gap,
    measure,
    random_prompts,
)
from gpu_legacy import job_legacy

SCRIPT = Path(__file__).resolve().parent / "gpu_rollout.py"  # its `_child` entry runs a job


class Progress:
    """What a job has measured so far. In a child it is written to the job's result file after every step,
    so a job killed at its timeout, or one whose CUDA context died (an illegal memory access), keeps the
    figures it had: the parent reads them beside the error."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.data: dict[str, Any] = {"status": "running", "cases": []}

    def add(self, case: dict[str, Any]) -> None:
        self.data["cases"].append(case)
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, default=str))
            tmp.replace(self.path)


def log_event(path: str | None, **event: Any) -> None:
    """One JSON line in the run log (gpu_rollout.RunLog): what started, in which process, when."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **event}, default=str) + "\n")


def build_dir(name: str, kind: str, root: Path, dry: bool) -> Path:
    """A self-contained HF dir (random weights, the tiny tokenizer) of model `name`: kind causal (an actor)
    or score (a critic / reward model, one output). Built once per --work dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    from kubealign.models import loading

    directory = root / f"{name}-{kind}"
    if (directory / "config.json").is_file():
        return directory
    config = hf_config((DRY_SHAPES if dry else SHAPES)[name])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "causal":
            model = AutoModelForCausalLM.from_config(config)
        else:
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
    model.generation_config = GenerationConfig(**{f"{k}_token_id": v for k, v in SPECIAL.items()})
    tmp = root / f".{directory.name}.tmp"
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(tmp, safe_serialization=True)
    loading.load_tokenizer("tiny-opt").save_pretrained(tmp)
    params = sum(p.numel() for p in model.parameters())
    (tmp / "kubealign-bench.json").write_text(json.dumps({"parameters": params, "shape": name, "kind": kind}))
    tmp.rename(directory)
    del model
    return directory


def parameters(directory: Path) -> int:
    return json.loads((directory / "kubealign-bench.json").read_text())["parameters"]


def prompt_texts(count: int, seed: int) -> list[str]:
    """Distinct texts of random letters, each far longer than 256 tiny-tokenizer tokens (cut from the left)."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))  # noqa: E731
    return [" ".join(word() for _ in range(300)) for _ in range(count)]


def write_prompts(root: Path, train: int, evaluation: int, name: str = "prompts") -> Path:
    """A data-split-like dir holding phase3_prompts (train and eval splits), what `kubealign ppo --prompts` reads."""
    import datasets

    directory = root / name
    if (directory / "phase3_prompts" / "dataset_dict.json").is_file():
        return directory
    texts = prompt_texts(train + evaluation, seed=0)
    split = {"train": texts[:train], "eval": texts[train:]}
    dd = datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"prompt": v, "chosen": [""] * len(v)}) for k, v in split.items()}
    )
    dd.save_to_disk(str(directory / "phase3_prompts"))
    return directory


@contextlib.contextmanager
def forced_path(path: str | None) -> Any:
    """The ppo stage's preflight with its choice replaced by `path` (he-plain | engine), so the benchmark can
    time a path the preflight would not pick here (the hybrid engine on CUDA with transformers 5).
    None: the preflight decides, as in a real run."""
    from kubealign.rl import preflight

    decide = preflight.decide

    def forced(hybrid: Any, zero: int, *rest: Any) -> Any:
        chosen = decide(hybrid, zero, *rest)
        if path == "engine":
            return preflight.Preflight("engine", None, [*chosen.notes, "benchmark: forced the plain engine"])
        block = {**preflight.hybrid_block(hybrid), "inference_tp_size": 1}  # one GPU
        return preflight.Preflight("he-plain", block, [*chosen.notes, "benchmark: forced the hybrid engine"])

    if path is not None:
        preflight.decide = forced
    try:
        yield
    finally:
        preflight.decide = decide


def ppo_config(spec: dict[str, Any]) -> Any:
    from kubealign.config.schema import PPOConfig

    zero = spec["zero"]
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]} if spec.get("lora") else {}
    return PPOConfig.model_validate(
        {
            "actor_zero_stage": zero,
            "critic_zero_stage": zero,
            "dtype": spec["dtype"],
            "generation_batch_size": spec["batch"],
            "micro_batch_size": spec["batch"],
            "max_prompt_len": spec["prompt_len"],
            "max_new_tokens": spec["new_tokens"],
            "num_iterations": max(spec.get("updates", 1), 1),
            "reuse_first_forward": "none",
            "sample_every_iterations": 0,
            "actor_lora": lora,
            # pinned: auto would pick the compiled engine on a GPU, and a path's figures would change meaning
            "rollout": {"engine": spec.get("engine", "hf")},
        }
    )


def build(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The four models exactly as the ppo stage builds them (kubealign.stages.ppo_models.build_models)."""
    from kubealign.stages import ppo_models
    from kubealign.training import distributed

    cfg = ppo_config(spec)
    distributed.init()
    distributed.seed_everything(cfg.seed)
    with forced_path(spec["path"]):
        models, check = ppo_models.build_models(cfg, spec["actor"], spec["critic"], spec["critic"], 1)
    return cfg, models, check


def job_rollout(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Path (c): kubealign.rl.rollout.generate through the PPOModels the ppo stage builds."""
    from kubealign.rl.rollout import generate
    from kubealign.training import distributed

    cfg, models, check = build(spec)
    ids, mask = random_prompts(max(spec["batches"]), spec["prompt_len"], spec["vocab"], distributed.device())

    def run(batch: int) -> Any:
        def once(n: int) -> Any:
            return generate(models, ids[:batch], mask[:batch], cfg.model_copy(update={"max_new_tokens": n})).input_ids

        return once

    progress.update(rollout_path=check.path, rollout_engine=models.engine, rollout_notes=check.notes)
    for b in sorted(spec["batches"]):  # the smaller first: a failure at the larger keeps its figures
        progress.add(measure(run(b), b, spec["prompt_len"], spec["new_tokens"], spec["reps"]))
    small = min(spec["batches"])
    progress.update(against_hf_eager=against_hf_eager(models, cfg, ids[:small], mask[:small], spec))
    return {"compiled_graphs": compiled_graphs()}


def compiled_graphs() -> int:
    """The graphs torch.compile made in this process: more than 0 shows that the compiled engine compiled."""
    import torch

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def against_hf_eager(models: Any, cfg: Any, ids: Any, mask: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The rollout engine against HF eager on the same weights, at the smaller batch's shapes (a compiled engine
    is compiled for them already): the mean and max |log-prob difference| of a sampled rollout's tokens between
    what the engine recorded (rl.rollout.SampledLogprobs, the mismatch correction's denominator) and HF eager's
    full forward (rl.experience.model_logprobs, the trainer's), and the greedy tokens (top-k 1) against HF
    eager's greedy generation, with the reference's top-2 margin at the first mismatch (bf16 near-ties of
    random weights are likely over 256 tokens)."""
    import torch

    from kubealign.rl import experience, losses
    from kubealign.rl.rollout import SampledLogprobs, generate

    full = cfg.model_copy(update={"max_new_tokens": spec["new_tokens"]})
    sampling = losses.Sampling.of(full)
    torch.manual_seed(1)
    recorder = SampledLogprobs(sampling)
    batch = generate(models, ids, mask, full, recorder)
    eos = models.tokenizer.eos_token_id
    attention, response = experience.response_masks(batch.input_ids, mask, batch.response_start_idx, eos)
    module = models.actor.module
    with torch.no_grad():
        trainer = experience.model_logprobs(module, batch.input_ids, attention, response, sampling)
    gap = logprob_gap(recorder.actions(batch), trainer, response)
    rollout = generate(models, ids, mask, full.model_copy(update={"top_k": 1})).input_ids[:, ids.shape[1] :]
    with torch.no_grad():
        reference, scores = greedy(module, ids, mask, spec["new_tokens"])
    tokens = compare(rollout, reference, scores, tie=1e-4 if spec["dtype"] == "fp32" else 0.1)
    return {"batch": int(ids.shape[0]), **gap, **tokens}


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


def job_hf(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Paths hf-eager and hf-static-compile: HF generate on the actor dir, one measured case per batch."""
    model, for_batch = hf_generate(Path(spec["actor"]), spec["dtype"], compiled=spec["compiled"])
    for batch in sorted(spec["batches"]):
        ids, mask = random_prompts(batch, spec["prompt_len"], spec["vocab"], model.device)
        progress.add(measure(for_batch(ids, mask), batch, spec["prompt_len"], spec["new_tokens"], spec["reps"]))
    return {}


def job_probe(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The harness's own check, no model: steps of {"add": {...}} (a measured case), {"raise": message},
    {"sleep": seconds} or {"exit": code} (the process dies without a word, as on a CUDA fault). The dry
    tests run it to prove that a failing or hanging case keeps its figures and stops no other case."""
    for step in spec["steps"]:
        if "add" in step:
            progress.add(step["add"])
        elif "raise" in step:
            raise RuntimeError(step["raise"])
        elif "sleep" in step:
            time.sleep(step["sleep"])
        elif "exit" in step:
            os._exit(step["exit"])
    return {}


def job_correctness(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Item 2: ppo iterations through kubealign's loop (ratio 1 and KL 0 at step 0), then the greedy rollout
    (top_k 1) of the trained actor against HF eager generation from the same, gathered weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from kubealign.rl.iteration import iteration
    from kubealign.rl.kl import KLController
    from kubealign.rl.rollout import generate
    from kubealign.training import distributed, export

    cfg, models, check = build(spec)
    device = distributed.device()
    before = export.gather_state(models.actor.module, keep=False)[1]
    kl, gen, history = KLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon), torch.Generator().manual_seed(0), []
    for step in range(spec["updates"]):
        ids, mask = random_prompts(cfg.generation_batch_size, cfg.max_prompt_len, spec["vocab"], device, seed=step + 1)
        metrics, _ = iteration(models, ids, mask, cfg, kl, gen)
        history.append({k: metrics[k] for k in ("kl", "approx_kl_first", "clip_fraction_first", "policy_loss")})
        progress.update(rollout_path=check.path, history=history)
    ids, mask = random_prompts(cfg.generation_batch_size, cfg.max_prompt_len, spec["vocab"], device, seed=99)
    rollout = generate(models, ids, mask, cfg.model_copy(update={"top_k": 1})).input_ids[:, ids.shape[1] :]
    model, _ = export.gather_model(models.actor, AutoModelForCausalLM, cfg.actor_lora, "CAUSAL_LM")
    after = export.gather_state(models.actor.module, keep=False)[1]
    dtype = torch.float32 if spec["dtype"] == "fp32" else torch.bfloat16
    model = (model.merge_and_unload() if cfg.actor_lora.r else model).to(device, dtype).eval()
    with torch.no_grad():
        reference, scores = greedy(model, ids, mask, cfg.max_new_tokens)
    first = history[0]
    checks = {
        "ratio_is_one_at_step_0": abs(first["approx_kl_first"]) < 1e-6 and first["clip_fraction_first"] == 0,
        "kl_is_zero_at_step_0": abs(first["kl"]) < 1e-4,
        "weights_changed": before != after,
    }
    tokens = compare(rollout, reference, scores, tie=1e-4 if spec["dtype"] == "fp32" else 0.1)
    passed = all(checks.values()) and (tokens["greedy_equal"] or tokens["near_tie"])
    return {
        "rollout_path": check.path,
        "rollout_notes": check.notes,
        "history": history,
        **checks,
        **tokens,
        "passed": passed,
    }


@contextlib.contextmanager
def iterations_only() -> Any:
    """The ppo stage without what the iteration measurement does not time: its evaluations before and after
    training (a rollout over the eval prompts each, and, for the compiled engine, a compilation for the eval
    batch's shape: the stage keeps at most 32 eval prompts) and the export of the trained models (about 60 s at
    OPT-1.3B + OPT-350M on the H200: gathering, hashing and saving some 7 GB; result.json is still written).
    Every iteration runs exactly as in a real run."""
    from kubealign.outputs import write_result
    from kubealign.stages import ppo

    evaluate, write_outputs = ppo.evaluate, ppo.write_outputs

    def no_evaluation(*args: Any, **kwargs: Any) -> dict[str, float]:
        return {"reward": 0.0, "kl": 0.0}

    def result_only(models: Any, cfg: Any, ema: Any, output: Path, result: dict[str, Any]) -> None:
        output.mkdir(parents=True, exist_ok=True)
        write_result(output, **result)

    ppo.evaluate, ppo.write_outputs = no_evaluation, result_only
    try:
        yield
    finally:
        ppo.evaluate, ppo.write_outputs = evaluate, write_outputs


def job_iteration(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Item 3: the real ppo stage (kubealign.stages.ppo.run) on the opt-1.3b-1gpu preset, tracking off, its
    evaluations and model export left out (iterations_only)."""
    import resource

    import torch

    from kubealign.config.load import load_config
    from kubealign.stages import ppo

    config = load_config(REPO / "configs" / "opt-1.3b-1gpu.yaml", spec["overrides"])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp, forced_path(spec.get("path")), iterations_only():
        result = ppo.run(
            config, Path(spec["prompts"]), Path(spec["actor"]), Path(spec["critic"]), None, Path(tmp) / "ppo"
        )
    history = result["history"][1:] or result["history"]  # the first iteration holds one-time warm-up
    peak = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        peak.update(
            peak_gpu_allocated_bytes=torch.cuda.max_memory_allocated(),
            peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved(),
        )
    return {
        "rollout_path": result["rollout_path"],
        "rollout_engine": result.get("rollout_engine"),
        "rollout_notes": result["rollout_notes"],
        "generation_batch_size": config.ppo.generation_batch_size,
        "micro_batch_size": config.ppo.micro_batch_size,
        # the first iteration, left out of the means: the compiled engine compiles its decode step in it
        "first_iteration_generation_s": result["history"][0]["generation_time_s"],
        "evaluation_and_export": "left out (gpu_jobs.iterations_only)",
        "iterations": len(result["history"]),
        "iterations_averaged": len(history),
        **iteration_figures(history),
        "history": result["history"],
        "wall_time_s": result["metrics"]["wall_time_s"],
        **peak,
    }


def run_job(spec: dict[str, Any], isolate: bool, timeout: float) -> dict[str, Any]:
    """A job in a fresh process (isolate: its own DeepSpeed state, peak memory and CUDA context; killed at
    `timeout`) or in this one (the CPU dry run: no timeout). Never raises: an error is a result."""
    if not isolate:
        progress = Progress()
        try:
            done = jobs()[spec["job"]](spec, progress)  # first: it fills progress.data
            return {**progress.data, "status": "ok", **done}
        except Exception as exc:
            return {**progress.data, **failure(exc)}
    return subprocess_job(spec, timeout, env=os.environ)


def jobs() -> dict[str, Any]:
    return {
        "hf": job_hf,
        "rollout": job_rollout,
        "correctness": job_correctness,
        "iteration": job_iteration,
        "legacy": job_legacy,
        "probe": job_probe,
    }


def subprocess_job(spec: dict[str, Any], timeout: float, env: Any) -> dict[str, Any]:
    """The job in a child process of its own session, killed with everything it started (a ninja build, the
    compile workers) at `timeout`: status `timeout`. What the child had measured comes back either way."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps({**spec, "result_file": str(out_file)}))
        cmd = [sys.executable, str(SCRIPT), "_child", str(spec_file)]
        # the child's output goes to this one's: a JIT build or a crash shows in the log
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child's group: what it started goes too
            proc.wait()
        found = json.loads(out_file.read_text()) if out_file.is_file() else {"cases": []}
        if code is None and found.get("status") == "ok":  # done, then hung on its way out (a teardown)
            return {**found, "note": f"killed at its timeout, {timeout:.0f} s, after it had finished"}
        if code is None:
            return {**found, "status": "timeout", "error": f"killed at its timeout, {timeout:.0f} s"}
        if found.get("status") in (None, "running"):
            return {**found, "status": "error", "error": f"the child exited with {code} before it finished"}
        return found


def die_with_parent() -> None:
    """A child runs in a process session of its own (so that a timeout kills what it started): the device
    machine then would not end it with the command, so it ends itself when its parent goes (Linux)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent went before the line above
            os._exit(1)


def child(spec_file: str) -> None:
    die_with_parent()
    spec = json.loads(Path(spec_file).read_text())
    log_event(spec.get("run_log"), event="child", job=spec["job"], case=spec.get("case"))
    progress = Progress(Path(spec["result_file"]))
    progress.write()
    try:
        done = jobs()[spec["job"]](spec, progress)  # first: it fills progress.data
        result = {**progress.data, "status": "ok", **done}
    except Exception as exc:
        traceback.print_exc()
        result = {**progress.data, **failure(exc)}
    progress.data = result
    progress.write()
