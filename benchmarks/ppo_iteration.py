"""PPO iteration time split (generation / experience passes / training), samples/s, and the reward and
KL it reaches, on the tiny CPU preset. Results go to benchmarks/results/<label>.json with the machine.

  python benchmarks/ppo_iteration.py                 # data-split -> sft (6 epochs) -> reward -> ppo (30 iterations)
  python benchmarks/ppo_iteration.py --iterations 60 --set ppo.actor_zero_stage=3

--compare REV: the PPO loop of commit REV (checked out with `git worktree` into a temp dir) against this
checkout, on the same SFT actor, reward/critic weights and prompts (built once, by this checkout), at two
shapes (tiny: 2-layer width-128 OPT; 4x256: 4-layer width-256 OPT, both with the tiny tokenizer) and
torch thread counts; each run is its own process, rounds interleave old and new, and the table gives
medians over rounds of: samples/s of the loop (samples / wall time from one iteration's start to the
next's, tracking and all), the ratio new/old, the time split (generation, experience, training, and
what is outside the three) and peak RSS. Written to benchmarks/results/<label>.json.

  python benchmarks/ppo_iteration.py --compare 892bdca --rounds 3 --iterations 12
  python benchmarks/ppo_iteration.py --compare 892bdca --new-set ppo.reuse_first_forward=both --label ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import machine  # noqa: E402

HERE = Path(__file__).resolve().parent


def kubealign(*args: str) -> None:
    exe = str(Path(sys.executable).parent / "kubealign")
    subprocess.run([exe, *args, "--set", "tracking.enabled=false"], check=True, env={**os.environ, "TQDM_DISABLE": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--sft-epochs", type=float, default=6.0, help="a half-trained actor leaves PPO room")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra ppo overrides")
    parser.add_argument("--label", default=None, help="results file name (default per mode)")
    parser.add_argument("--compare", metavar="REV", help="run commit REV's PPO loop beside this checkout's")
    parser.add_argument("--shapes", default="tiny,4x256", help="--compare: comma-separated, of " + ",".join(SHAPES))
    parser.add_argument("--threads", default="1,2", help="--compare: torch thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="--compare: interleaved rounds (old, new)")
    parser.add_argument("--work", help="--compare: keep the prepared models here (reused when present)")
    parser.add_argument(
        "--new-set",
        dest="new_overrides",
        action="append",
        default=[],
        help="--compare: ppo overrides for this checkout only (settings REV does not know)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.compare:
        return compare(args)
    args.label = args.label or "ppo-tiny-opt-cpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        kubealign("data-split", "--output", str(work / "split"))
        kubealign(
            "sft",
            "--data",
            str(work / "split"),
            "--output",
            str(work / "sft"),
            "--set",
            f"sft.num_train_epochs={args.sft_epochs}",
        )
        kubealign("reward", "--data", str(work / "split"), "--output", str(work / "rm"))
        extra = [a for o in args.overrides for a in ("--set", o)]
        kubealign(
            "ppo",
            "--prompts",
            str(work / "split"),
            "--actor",
            str(work / "sft"),
            "--critic",
            str(work / "rm"),
            "--output",
            str(work / "ppo"),
            "--set",
            f"ppo.num_iterations={args.iterations}",
            *extra,
        )
        result = json.loads((work / "ppo" / "result.json").read_text())
    history = result["history"][1:] or result["history"]  # the first iteration includes one-time warm-up
    mean = {
        k: sum(h[k] for h in history) / len(history)
        for k in ("generation_time_s", "experience_time_s", "training_time_s", "samples_per_s")
    }
    total = mean["generation_time_s"] + mean["experience_time_s"] + mean["training_time_s"]
    record = {
        "preset": "tiny-cpu",
        "overrides": args.overrides,
        "iterations": args.iterations,
        "rollout_path": result["rollout_path"],
        "per_iteration_mean": mean,
        "time_share": {k.removesuffix("_time_s"): mean[k] / total for k in mean if k.endswith("_time_s")},
        "reward_before": result["metrics"]["reward_before"],
        "reward_after": result["metrics"]["reward_after"],
        "kl_after": result["metrics"]["kl_after"],
        "machine": machine(),
    }
    out = HERE / "results" / f"{args.label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    share = ", ".join(f"{k} {v:.0%}" for k, v in record["time_share"].items())
    print(f"ppo ({record['rollout_path']}): {mean['samples_per_s']:.1f} samples/s; time split: {share}")
    print(f"eval reward {record['reward_before']:.3f} -> {record['reward_after']:.3f}, KL {record['kl_after']:.3f}")
    print(f"written to {out}")


# --- --compare: old commit beside this checkout, interleaved ------------------------------------------------

SHAPES = {  # OPT dimensions; the tokenizer (vocabulary 1024) is tiny-opt's for both
    "tiny": {"hidden_size": 128, "ffn_dim": 512, "num_hidden_layers": 2, "num_attention_heads": 4},
    "4x256": {"hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 4, "num_attention_heads": 4},
}
SFT_EPOCHS = {"tiny": 6.0, "4x256": 3.0}  # half-trained actors: responses of mixed length, most with EOS
# The measurement: batch 16, 16 new tokens, ZeRO 0, fp32, one optimizer step per iteration.
PPO_SETTINGS = [
    "ppo.max_new_tokens=16",
    "ppo.generation_batch_size=16",
    "ppo.micro_batch_size=16",
    "ppo.actor_zero_stage=0",
    "ppo.critic_zero_stage=0",
    "ppo.dtype=fp32",
]


def prepare(shape: str, work: Path) -> dict[str, str]:
    """data-split (shared), then SFT actor and reward model of `shape`, by this checkout; reused if there."""
    if not (work / "split").is_dir():
        kubealign("data-split", "--output", str(work / "split"))
    sft, rm = work / f"{shape}-sft", work / f"{shape}-rm"
    if not (sft / "result.json").is_file():
        base = "tiny-opt"
        if shape != "tiny":
            base = str(build_shape(shape, work / f"{shape}-init"))
        kubealign(
            "sft",
            "--data",
            str(work / "split"),
            "--output",
            str(sft),
            "--set",
            f"sft.model={base}",
            "--set",
            f"sft.num_train_epochs={SFT_EPOCHS[shape]}",
        )
        kubealign(
            "reward",
            "--data",
            str(work / "split"),
            "--output",
            str(rm),
            "--set",
            f"reward.model={base}",
            "--set",
            "reward.num_train_epochs=1",
        )
    return {"split": str(work / "split"), "actor": str(sft), "critic": str(rm)}


def build_shape(shape: str, directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from kubealign.models import loading, tiny

    tokenizer = loading.load_tokenizer("tiny-opt")
    config = tiny.model_config("opt", tokenizer)
    for key, value in {**SHAPES[shape], "word_embed_proj_dim": SHAPES[shape]["hidden_size"]}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def child(spec: dict) -> None:
    """One PPO stage run in this process (kubealign from spec['src']), every iteration timed from outside."""
    import resource

    import torch

    torch.set_num_threads(spec["threads"])
    import kubealign
    from kubealign.config.load import load_config
    from kubealign.stages import ppo

    assert Path(kubealign.__file__).resolve().is_relative_to(Path(spec["src"]).resolve()), kubealign.__file__
    calls: list[dict] = []
    inner = ppo.iteration

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        metrics, exp = inner(*args, **kwargs)
        calls.append(
            {
                "start": start,
                "cpu": cpu,
                "samples": int(exp.input_ids.shape[0]),
                **{
                    k: metrics[k]
                    for k in ("generation_time_s", "experience_time_s", "training_time_s", "response_length")
                },
            }
        )
        return metrics, exp

    ppo.iteration = timed
    # Each side's own tiny-cpu preset (the editable install maps `configs` to this checkout's, whose newer
    # sections an older commit would refuse); their ppo sections are the same.
    preset = Path(spec["src"]) / "configs" / "tiny-cpu.yaml"
    config = load_config(preset, [*PPO_SETTINGS, f"ppo.num_iterations={spec['iterations']}", *spec["overrides"]])
    out = Path(spec["out"])
    result = ppo.run(config, Path(spec["split"]), Path(spec["actor"]), Path(spec["critic"]), None, out / "ppo")
    loops = []
    for this, following in zip(calls[1:], calls[2:], strict=False):  # the first iteration warms up
        loop = following["start"] - this["start"]
        phases = {k.removesuffix("_time_s"): this[k] for k in this if k.endswith("_time_s")}
        loops.append(
            {
                "loop_s": loop,
                "cpu_s": following["cpu"] - this["cpu"],
                "samples": this["samples"],
                **phases,
                "outside": loop - sum(phases.values()),
                "response_length": this["response_length"],
            }
        )
    record = {
        "loops": loops,
        "rollout_path": result["rollout_path"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / "timing.json").write_text(json.dumps(record))


def run_child(src: Path, prepared: dict, threads: int, iterations: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            **prepared,
            "src": str(src),
            "threads": threads,
            "iterations": iterations,
            "out": tmp,
            "overrides": overrides,
        }
        env = {
            **os.environ,
            "PYTHONPATH": str(src),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TQDM_DISABLE": "1",
        }
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
            env.pop(name, None)  # tracking on, to a fresh local store in the run's temp dir (the default)
        subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            check=True,
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
        )
        return json.loads((Path(tmp) / "timing.json").read_text())


def summarize(runs: list[dict]) -> dict:
    """Medians over runs of each run's per-iteration medians."""
    med = statistics.median
    per_run = []
    for run in runs:
        loops = run["loops"]
        loop = med(x["loop_s"] for x in loops)
        per_run.append(
            {
                "samples_per_s": med(x["samples"] / x["loop_s"] for x in loops),
                "samples_per_cpu_s": med(x["samples"] / x["cpu_s"] for x in loops),  # less sensitive to other load
                "loop_s": loop,
                **{
                    f"{k}_share": med(x[k] / x["loop_s"] for x in loops)
                    for k in ("generation", "experience", "training", "outside")
                },
                "response_length": med(x["response_length"] for x in loops),
                "peak_rss_mb": run["peak_rss_mb"],
            }
        )
    return {
        **{k: med(r[k] for r in per_run) for k in per_run[0]},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in per_run),
        "samples_per_s_runs": [round(r["samples_per_s"], 2) for r in per_run],
        "rollout_path": runs[0]["rollout_path"],
    }


def compare(args: argparse.Namespace) -> None:
    repo = HERE.parent
    shapes, threads = args.shapes.split(","), [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        old_src = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(old_src), args.compare],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            rev = subprocess.run(
                ["git", "-C", str(old_src), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
            ).stdout.strip()
            work = Path(args.work) if args.work else Path(tmp) / "work"
            work.mkdir(parents=True, exist_ok=True)
            prepared = {shape: prepare(shape, work) for shape in shapes}
            runs: dict[tuple, list] = {}
            for r in range(args.rounds):
                for shape in shapes:
                    for n in threads:
                        order = [("old", old_src), ("new", repo)]
                        for name, src in order if r % 2 == 0 else order[::-1]:  # alternate who goes first
                            extra = args.overrides + (args.new_overrides if name == "new" else [])
                            timing = run_child(src, prepared[shape], n, args.iterations, extra)
                            runs.setdefault((shape, n, name), []).append(timing)
                            print(
                                f"round {r + 1} {shape} threads {n} {name}: "
                                f"{statistics.median(x['samples'] / x['loop_s'] for x in timing['loops']):.1f} "
                                "samples/s",
                                flush=True,
                            )
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(old_src)], check=False)
    table = []
    for shape in shapes:
        for n in threads:
            old, new = summarize(runs[(shape, n, "old")]), summarize(runs[(shape, n, "new")])
            table.append(
                {
                    "shape": shape,
                    "threads": n,
                    "old": old,
                    "new": new,
                    "ratio": new["samples_per_s"] / old["samples_per_s"],
                    "ratio_cpu": new["samples_per_cpu_s"] / old["samples_per_cpu_s"],
                }
            )
    record = {
        "harness": "ppo_iteration.py --compare",
        "old_rev": rev,
        "new": "this checkout: "
        + subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip(),
        "settings": {
            "ppo": PPO_SETTINGS + args.overrides,
            "new_only": args.new_overrides,
            "iterations": args.iterations,
            "rounds": args.rounds,
            "shapes": {s: SHAPES[s] for s in shapes},
            "sft_epochs": {s: SFT_EPOCHS[s] for s in shapes},
            "tracking": "on (local sqlite store per run)",
            "measure": "median over rounds of the median "
            "per-iteration loop (iteration start to next iteration start), first iteration excluded; "
            "samples_per_cpu_s: the same per CPU-second of the process (user + system, all its threads)",
        },
        "table": table,
        "machine": machine(),
    }
    out = HERE / "results" / f"{args.label or 'ppo-compare-cpu'}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    for row in table:
        o, n = row["old"], row["new"]
        split = ", ".join(f"{k} {n[k + '_share']:.1%}" for k in ("generation", "experience", "training", "outside"))
        print(
            f"{row['shape']:>6} threads {row['threads']}: {o['samples_per_s']:.1f} -> {n['samples_per_s']:.1f} "
            f"samples/s ({row['ratio']:.2f}x; per CPU-second {row['ratio_cpu']:.2f}x); new split {split}; "
            f"peak RSS {o['peak_rss_mb']:.0f} -> {n['peak_rss_mb']:.0f} MB"
        )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
