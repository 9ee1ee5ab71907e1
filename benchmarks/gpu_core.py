"""The measuring parts of benchmarks/gpu_rollout.py: shapes, the environment record, timing a generate
call, the decode roofline, greedy-token comparison. Pure where it can be (tests/test_gpu_harness.py checks
the arithmetic by hand)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

SPECIAL = {"pad": 0, "bos": 1, "eos": 2}  # the tiny tokenizer's special ids (kubealign.models.tiny)
SHAPES = {
    "opt-1.3b": {
        "arch": "opt",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "ffn_dim": 8192,
        "vocab_size": 50272,
        "word_embed_proj_dim": 2048,
        "max_position_embeddings": 2048,
    },
    "opt-350m": {
        "arch": "opt",
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "ffn_dim": 4096,
        "vocab_size": 50272,
        "word_embed_proj_dim": 512,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": False,
    },
    # About OPT-1.3B's size (1.35e9 parameters), multi-head attention (kv heads == heads: no GQA), the layout
    # DeepSpeed's LLaMA injection policy supports.
    "llama-1.3b": {
        "arch": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 5504,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}
DRY_SHAPES = {
    "opt-1.3b": {
        **SHAPES["opt-1.3b"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "ffn_dim": 256,
        "vocab_size": 1024,
        "word_embed_proj_dim": 64,
    },
    "opt-350m": {
        **SHAPES["opt-350m"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "ffn_dim": 256,
        "vocab_size": 1024,
        "word_embed_proj_dim": 32,
    },
    "llama-1.3b": {
        **SHAPES["llama-1.3b"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 256,
        "vocab_size": 1024,
    },
}
ACTORS = {"opt": "opt-1.3b", "llama": "llama-1.3b"}

# Peak memory bandwidth from the vendors' data sheets, by a substring of torch.cuda.get_device_name(); the
# first match wins. The decode roofline: every step reads every weight once, so
#   min_step_s = weight_bytes / bandwidth   (and, counting the KV cache read, + kv_bytes_mean / bandwidth).
SPEC_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
)
ROOFLINE_FORMULA = (
    "min_step_ms = weight_bytes / bandwidth_Bps * 1e3 (weights only, the issue's bound); "
    "min_step_ms_with_kv = (weight_bytes + kv_bytes_mean) / bandwidth_Bps * 1e3, kv_bytes_mean = 2 * layers * "
    "kv_dim * batch * (prompt_len + (new_tokens + 1) / 2) * dtype_bytes; fraction = min_step_ms / ms_per_step"
)
# DeepSpeed-Chat's step 3 for OPT-1.3B (actor) + OPT-350M (reward), one epoch, as stated in the issue.
DSCHAT_EPOCH = {
    "prompts": 131_900,
    "prompt_tokens": 256,
    "new_tokens": 256,
    "published_hours": 11.7,
    "published_hardware": "1 x A100-80G",
}
GEN_PATHS = (
    "hf-eager",
    "hf-static-compile",
    "kubealign-engine-z2",
    "kubealign-he-z2",
    "kubealign-compiled-z2",  # kubealign-he-z2 with ppo.rollout.engine compiled (rl.engines)
    "kubealign-he-z3",
    "legacy",
)
LEGACY_VARIANTS = (("he-injected-z2", 2, False), ("he-injected-z2-cuda-graph", 2, True), ("he-injected-z3", 3, False))
NEEDS_CUDA = "skipped: needs CUDA"


# torch.distributed's rendezvous variables. The benchmark is one process (a job's child too): inherited
# values name a port that another process (a launcher, a test runner that initialized its own group)
# may hold, so main() drops them and each process picks a free port of its own.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(dry: bool) -> dict[str, Any]:
    """Everything a measurement's size depends on; written into every record."""
    if dry:
        return {
            "dry": True,
            "dtype": "fp32",
            "prompt_len": 8,
            "new_tokens": 8,
            "batches": [2, 3],
            "reps": 1,
            "correctness": {"updates": 1, "batch": 2, "prompt_len": 8, "new_tokens": 8},
            "iteration": {"iterations": 2, "prompt_len": 8, "new_tokens": 8, "batch": 2},
        }
    return {
        "dry": False,
        "dtype": "bf16",
        "prompt_len": 256,
        "new_tokens": 256,
        "batches": [16, 64],
        "reps": 2,
        "correctness": {"updates": 3, "batch": 4, "prompt_len": 32, "new_tokens": 32},
        "iteration": {"iterations": 4, "prompt_len": 256, "new_tokens": 256, "batch": None},
    }


def scrub(text: str) -> str:
    """Machine paths out of anything recorded (results are committed): the repo becomes '.', other
    absolute temp/home paths keep only their last part."""
    text = text.replace(str(REPO), ".")
    return re.sub(r"/(?:tmp|root|home|work|var)/(?:[^\s'\"]*/)?([^/\s'\"]+)", r"<tmp>/\1", text)


def version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as found

    try:
        return found(name)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        **{name: version(name) for name in ("transformers", "deepspeed", "peft", "datasets", "tokenizers")},
        "cpu_count": os.cpu_count(),
        "gpu": None,
        "driver": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    return env


def slug(env: dict[str, Any], dry: bool) -> str:
    if dry or not env.get("gpu"):
        return "cpu-dry" if dry else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")


def failure(exc: BaseException) -> dict[str, str]:
    lines = [line for line in traceback.format_exception(exc) if line.strip()]
    return {
        "status": "error",
        "error": scrub(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"),
        "where": scrub(lines[-2].strip()[:400]) if len(lines) > 1 else "",
    }


def hf_config(shape: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, OPTConfig

    fields = {k: v for k, v in shape.items() if k != "arch"}
    ids = {"pad_token_id": SPECIAL["pad"], "bos_token_id": SPECIAL["bos"], "eos_token_id": SPECIAL["eos"]}
    return (OPTConfig if shape["arch"] == "opt" else LlamaConfig)(**fields, **ids)


def random_prompts(batch: int, length: int, vocab: int, device: Any, seed: int = 0) -> tuple[Any, Any]:
    """[batch, length] ids drawn uniformly from the vocabulary past the special ids; all real (mask 1)."""
    import torch

    ids = torch.randint(4, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(device), torch.ones_like(ids).to(device)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    out = fn(*args)
    sync()
    return time.perf_counter() - start, out


def measure(generate: Any, batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict[str, Any]:
    """generate(n) -> [batch, prompt_len + generated] ids. A full-length warm-up (compilation, graph capture),
    the prefill alone (n = 1), then `reps` full runs; the best is kept. A decode step is
    (full - prefill) / (generated - 1)."""
    import torch

    torch.manual_seed(0)
    warm_s, _ = timed(generate, new_tokens)
    prefill_s = min(timed(generate, 1)[0] for _ in range(max(reps, 1)))
    runs = [timed(generate, new_tokens) for _ in range(reps)]
    full_s, out = min(runs, key=lambda r: r[0])
    generated = int(out.shape[1]) - prompt_len
    step_s = (full_s - prefill_s) / max(generated - 1, 1)
    return {
        "batch": batch,
        "generated_tokens": generated,
        "warmup_s": warm_s,
        "prefill_s": prefill_s,
        "full_s": full_s,
        "full_s_runs": [r[0] for r in runs],
        "ms_per_decode_step": step_s * 1e3,
        "tokens_per_s": batch * generated / full_s,
        "decode_tokens_per_s": batch / max(step_s, 1e-12),
    }


def spec_bandwidth(gpu: str | None) -> float | None:
    """The data-sheet memory bandwidth (bytes/s) of a GPU by its torch name; the first matching row wins,
    so a variant ("H100 NVL") is listed before its family ("H100")."""
    return next((bw for key, bw in SPEC_BANDWIDTH if gpu and key in gpu), None)


def dschat_epoch(samples_per_s: float, comparable: bool) -> dict[str, Any]:
    """DeepSpeed-Chat's step-3 epoch (one sample per prompt) at this loop speed, beside its published time."""
    hours = DSCHAT_EPOCH["prompts"] / samples_per_s / 3600
    return {
        "hours": hours,
        "published_hours": DSCHAT_EPOCH["published_hours"],
        "speedup_vs_published": DSCHAT_EPOCH["published_hours"] / hours,
        "comparable": comparable,
    }


def iteration_figures(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The ppo stage's averaged iterations (history lines): the mean of each time and rate, each part's share of
    an iteration, samples/s as all their samples over all their time (not a mean of rates; as the stage's own
    summary has it) and the generation share."""
    parts = ("generation_time_s", "experience_time_s", "training_time_s")
    keys = (*parts, "samples_per_s", "response_length")
    mean = {k: sum(h[k] for h in history) / len(history) for k in keys}
    total = sum(mean[k] for k in parts)
    samples = sum(h["samples_per_s"] * sum(h[k] for k in parts) for h in history)
    return {
        "samples_per_s": samples / (total * len(history)),
        "generation_share": mean["generation_time_s"] / total,
        "per_iteration_mean": mean,
        "time_share": {k.removesuffix("_time_s"): mean[k] / total for k in parts},
    }


def bandwidth(env: dict[str, Any]) -> dict[str, Any]:
    """The data-sheet bandwidth of the GPU (None on a CPU) and a measured copy bandwidth (bytes read +
    written per second); the roofline uses the data sheet where there is one, else the measured copy."""
    import torch

    spec = spec_bandwidth(env.get("gpu"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(10)])
    measured = 2 * n * 10 / seconds
    src = dst = None  # noqa: F841  (freed: the lambda above held them)
    if device == "cuda":
        torch.cuda.empty_cache()  # the jobs run in children: this process keeps no GPU memory it does not use
    return {
        "spec_Bps": spec,
        "measured_copy_Bps": measured,
        "used_Bps": spec or measured,
        "used": "data sheet" if spec else "measured copy (no data-sheet figure for this device)",
        "formula": ROOFLINE_FORMULA,
    }


def roofline(case: dict[str, Any], shape: dict[str, Any], params: int, s: dict[str, Any], bw: float) -> None:
    """Add the roofline figures to a measured case (in place)."""
    nbytes = 2 if s["dtype"] in ("bf16", "fp16") else 4
    weight = params * nbytes
    heads = shape.get("num_key_value_heads", shape["num_attention_heads"])
    kv_dim = heads * shape["hidden_size"] // shape["num_attention_heads"]
    context = s["prompt_len"] + (s["new_tokens"] + 1) / 2
    kv = 2 * shape["num_hidden_layers"] * kv_dim * case["batch"] * context * nbytes
    bound, bound_kv = weight / bw * 1e3, (weight + kv) / bw * 1e3
    case.update(
        weight_bytes=weight,
        kv_bytes_mean=kv,
        min_step_ms=bound,
        min_step_ms_with_kv=bound_kv,
        roofline_fraction=bound / case["ms_per_decode_step"],
        roofline_fraction_with_kv=bound_kv / case["ms_per_decode_step"],
    )


def compare(rollout: Any, reference: Any, scores: Any, tie: float) -> dict[str, Any]:
    """Greedy response tokens [B, n] of a rollout path against the reference's; at the first mismatch, the
    reference's top-2 logit margin there (a tiny margin is a near-tie of random weights, not a defect)."""
    n = min(rollout.shape[1], reference.shape[1])
    equal = rollout[:, :n].cpu() == reference[:, :n].cpu()
    result: dict[str, Any] = {
        "compared_tokens": int(equal.numel()),
        "match_fraction": float(equal.float().mean()),
        "greedy_equal": bool(equal.all()),
        "first_mismatch": None,
        "margin_at_mismatch": None,
    }
    if not result["greedy_equal"]:
        col = int((~equal).any(0).nonzero()[0])
        row = int((~equal[:, col]).nonzero()[0])
        top = scores[col][row].float().topk(2).values
        result.update(first_mismatch=[row, col], margin_at_mismatch=float(top[0] - top[1]))
    result["near_tie"] = result["margin_at_mismatch"] is not None and result["margin_at_mismatch"] < tie
    return result


def logprob_gap(recorded: Any, trainer: Any, response: Any) -> dict[str, Any]:
    """|log-prob difference| [N, A] of the sampled response tokens between what the rollout engine recorded
    (rl.rollout.SampledLogprobs) and the trainer's full forward, over the response actions (response mask 1):
    mean and max, nats, and how many tokens. recorded None: the engine recorded nothing (no figures)."""
    if recorded is None:
        return {"logprob_diff_mean": None, "logprob_diff_max": None, "logprob_tokens": 0}
    diff = (trainer.double() - recorded.double()).abs()[response.bool()]
    count = int(diff.numel())
    return {
        "logprob_diff_mean": float(diff.mean()) if count else None,
        "logprob_diff_max": float(diff.max()) if count else None,
        "logprob_tokens": count,
    }


def greedy(model: Any, ids: Any, mask: Any, new_tokens: int) -> tuple[Any, Any]:
    """HF generate, greedy, eager (no compile, the model's default attention): (response ids, scores)."""
    from transformers import GenerationConfig

    settings_ = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        **{f"{k}_token_id": v for k, v in SPECIAL.items()},
    )
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings_)
    return out.sequences[:, ids.shape[1] :], out.scores
