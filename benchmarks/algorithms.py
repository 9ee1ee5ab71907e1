"""PPO vs GRPO vs RLOO vs DPO on the demo task: quality against SFT, KL, wall time and peak memory, over seeds.

For each seed (data, SFT, reward, PPO, DPO and evaluation seeds all set to it) this runs data-split, sft and
reward once with the tiny-cpu preset, then the four routes from the same SFT model back to back, each its
own stage command (`kubealign ppo --set ppo.algorithm=ppo|grpo|rloo`, `kubealign dpo`), then `kubealign
evaluate` of each candidate against the same SFT baseline and reward model. Per route and seed it records:

* win-rate over SFT with its 95 % percentile-bootstrap interval: evaluate records only the lower bound, so
  both ends are recomputed here from the per-prompt scores in its eval_samples.json, with evaluate's own
  resampling (same seed, same 2000 resamples: the lower end must equal its win_rate_lower_bound, checked);
* KL to the SFT model (evaluate's kl_to_baseline, sampled on the candidate's answers, the same for every
  route), the preferred-answer and well-formed rates (the synthetic grammar's judgement);
* the route stage's wall time (process start to exit, imports included; also the stage's own in-process
  wall_time_s), CPU seconds, and its peak RSS (ru_maxrss from os.wait4 of the stage process; on CPU the
  stage is one process, no torchrun), plus the 1-minute load average when it started.

The cores may be shared with other jobs: before each timed route stage the harness waits (up to 5 min)
until the 1-minute load average is below 1.5. The routes of one seed run back to back, their order rotated
from seed to seed; wall times are also reported as a ratio to PPO's within the same seed.

  python benchmarks/algorithms.py                      # seeds 1234 1 2 -> results/algorithms-tiny-cpu.json
  python benchmarks/algorithms.py --seeds 7 --routes ppo dpo --label try
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
from demo_quality import SEEDED, kubealign  # noqa: E402
from train_throughput import machine  # noqa: E402

HERE = Path(__file__).resolve().parent
ROUTES = ("ppo", "grpo", "rloo", "dpo")
SEEDS = (*SEEDED, "dpo.seed")
QUIET = ("--set", "tracking.enabled=false")
EVAL_KEYS = (
    "win_rate",
    "win_rate_lower_bound",
    "tie_rate",
    "kl_to_baseline",
    "baseline_preferred_rate",
    "candidate_preferred_rate",
    "baseline_well_formed_rate",
    "candidate_well_formed_rate",
    "baseline_on_topic_rate",
    "candidate_on_topic_rate",
    "baseline_reward_mean",
    "candidate_reward_mean",
    "candidate_length_mean",
    "prompts",
)


def wait_for_quiet(limit: float = 1.5, poll_s: float = 10.0, max_wait_s: float = 300.0) -> dict:
    """Wait until the 1-minute load average is below `limit` (at most `max_wait_s`); report what was seen."""
    started = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - started < max_wait_s:
        time.sleep(poll_s)
    return {"waited_s": round(time.monotonic() - started, 1), "loadavg_at_start": list(os.getloadavg())}


def timed(args: list[str], log: Path) -> dict:
    """Run one kubealign stage as a child process: wall time, CPU time and peak RSS (its ru_maxrss)."""
    exe = str(Path(sys.executable).parent / "kubealign")
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with log.open("w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen([exe, *args], env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4; keeps Popen from waiting again
    record = {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "exit_code": proc.returncode,
    }
    if proc.returncode != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        record["error"] = next((line for line in reversed(lines) if "rror" in line), lines[-1] if lines else "")
        record["command"] = " ".join(["kubealign", *args])
    return record


def bootstrap_interval(outcomes: list[float], seed: int, level: float = 0.95, resamples: int = 2000) -> list[float]:
    """Both ends of the percentile-bootstrap interval, resampled exactly as evaluate's bootstrap_lower_bound."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor(outcomes, dtype=torch.float64)
    picks = torch.randint(len(outcomes), (resamples, len(outcomes)), generator=generator)
    means = values[picks].mean(dim=1)
    return [float(torch.quantile(means, (1 - level) / 2)), float(torch.quantile(means, (1 + level) / 2))]


def wins(eval_dir: Path) -> list[float]:
    """Per-prompt win indicators (candidate's reward-model score above the baseline's, as evaluate counts)."""
    rows = json.loads((eval_dir / "eval_samples.json").read_text())
    return [float(r["candidate_score"] - r["baseline_score"] > 1e-6) for r in rows]


def train_route(route: str, d: dict[str, str], sets: list[str], work: Path) -> dict:
    out = str(work / route)
    if route == "dpo":
        args = ["dpo", "--data", d["split"], "--model", d["sft"], "--output", out, *sets]
    else:
        args = [
            "ppo",
            "--prompts",
            d["split"],
            "--actor",
            d["sft"],
            "--critic",
            d["rm"],
            "--output",
            out,
            *sets,
            "--set",
            f"ppo.algorithm={route}",
        ]
    record = {**wait_for_quiet(), **timed(args, work / f"{route}.log")}
    if record["exit_code"] == 0:
        result = json.loads((work / route / "result.json").read_text())
        record["stage_wall_time_s"] = result["metrics"].get("wall_time_s")
        keys = ("kl_after", "reward_after", "after_kl", "after_rewards_accuracy", "after_loss")
        record["route_metrics"] = {k: result["metrics"][k] for k in keys if k in result["metrics"]}
    return record


def evaluate_route(route: str, d: dict[str, str], sets: list[str], work: Path, seed: int) -> dict:
    out = work / f"eval-{route}"
    args = [
        "evaluate",
        "--prompts",
        d["split"],
        "--baseline",
        d["sft"],
        "--candidate",
        str(work / route),
        "--reward",
        d["rm"],
        "--output",
        str(out),
        *sets,
    ]
    run = timed(args, work / f"eval-{route}.log")
    if run["exit_code"] != 0:
        return {"evaluate": run}
    metrics = json.loads((out / "result.json").read_text())["metrics"]
    lower, upper = bootstrap_interval(wins(out), seed)
    if abs(lower - metrics["win_rate_lower_bound"]) > 1e-9:
        raise RuntimeError(f"{route}: recomputed lower bound {lower} != evaluate's {metrics['win_rate_lower_bound']}")
    return {**{k: metrics[k] for k in EVAL_KEYS}, "win_rate_interval": [lower, upper], "evaluate_wall_s": run["wall_s"]}


def one_seed(work: Path, seed: int, routes: list[str], overrides: list[str]) -> dict:
    sets = [a for o in [*(f"{k}={seed}" for k in SEEDS), "tracking.enabled=false", *overrides] for a in ("--set", o)]
    d = {name: str(work / name) for name in ("split", "sft", "rm")}
    shared = {
        "data-split": kubealign("data-split", "--output", d["split"], *sets),
        "sft": kubealign("sft", "--data", d["split"], "--output", d["sft"], *sets),
        "reward": kubealign("reward", "--data", d["split"], "--output", d["rm"], *sets),
    }
    runs = {}
    for route in routes:
        runs[route] = train_route(route, d, sets, work)
        print(
            f"  seed {seed} {route}: {runs[route]['wall_s']:.1f} s, {runs[route]['peak_rss_mib']:.0f} MiB, "
            f"load {runs[route]['loadavg_at_start'][0]:.2f}"
            + (f"  FAILED: {runs[route]['error']}" if runs[route]["exit_code"] else ""),
            flush=True,
        )
    for route in routes:
        if runs[route]["exit_code"] == 0:
            runs[route].update(evaluate_route(route, d, sets, work, seed))
    base = runs.get("ppo", {}).get("wall_s") if runs.get("ppo", {}).get("exit_code") == 0 else None
    for r in runs.values():
        r["wall_vs_ppo"] = r["wall_s"] / base if base else None
    # evaluate samples the baseline with the same seed each time, so these must all be one value
    baseline = sorted({r["baseline_preferred_rate"] for r in runs.values() if "baseline_preferred_rate" in r})
    return {
        "seed": seed,
        "route_order": routes,
        "shared_stage_wall_s": shared,
        "baseline_preferred_rates": baseline,
        "routes": runs,
    }


def spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    mean = format(statistics.fmean(values), fmt)
    return mean if len(values) == 1 else f"{mean} ({format(min(values), fmt)}-{format(max(values), fmt)})"


COLUMNS = (
    ("preferred answers", "candidate_preferred_rate", ".0%"),
    ("well formed", "candidate_well_formed_rate", ".0%"),
    ("win-rate vs SFT", "win_rate", ".2f"),
    ("KL to SFT", "kl_to_baseline", ".2f"),
    ("wall time (s)", "wall_s", ".1f"),
    ("wall / PPO's", "wall_vs_ppo", ".2f"),
    ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
)


def table(runs: list[dict], routes: list[str]) -> str:
    """Markdown: per route, the mean (min-max over seeds) of each column; the win-rate's 95 % interval as the
    mean of the seeds' lower and upper bounds."""
    rows = ["| route | " + " | ".join(name for name, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for route in routes:
        ok = [s["routes"][route] for s in runs if "win_rate" in s["routes"][route]]
        cells = [spread([r[key] for r in ok], fmt) for _, key, fmt in COLUMNS]
        if ok:
            lo, hi = (statistics.fmean(r["win_rate_interval"][i] for r in ok) for i in (0, 1))
            cells[2] += f" [{lo:.2f}-{hi:.2f}]"
        failed = f" ({len(runs) - len(ok)} of {len(runs)} failed)" if len(ok) < len(runs) else ""
        rows.append(f"| {route}{failed} | " + " | ".join(cells) + " |")
    per_seed = {s["seed"]: r["baseline_preferred_rate"] for s in runs for r in s["routes"].values() if "win_rate" in r}
    rows.append(f"| SFT (baseline) | {spread(list(per_seed.values()), '.0%')} |" + " |" * (len(COLUMNS) - 1))
    return "\n".join(rows)


def git_revision() -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout  # noqa: E731
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted_changes": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    parser.add_argument("--label", default="algorithms-tiny-cpu")
    args = parser.parse_args()
    record = {
        "preset": "tiny-cpu",
        "command": " ".join(["python", *sys.argv]),
        "overrides": args.overrides,
        "git": git_revision(),
        "machine": machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": [],
    }
    out = HERE / "results" / f"{args.label}.json"
    for i, seed in enumerate(args.seeds):
        order = args.routes[i % len(args.routes) :] + args.routes[: i % len(args.routes)]
        print(f"seed {seed}: routes in order {' '.join(order)}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            record["runs"].append(one_seed(Path(tmp), seed, order, args.overrides))
        out.write_text(json.dumps(record, indent=2) + "\n")  # what ran so far survives a later failure
    record["table"] = table(record["runs"], args.routes)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(record["table"])
    print(f"written to {out}")


if __name__ == "__main__":
    main()
