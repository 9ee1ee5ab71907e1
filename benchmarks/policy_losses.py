"""ppo.policy_loss (ppo | gspo | cispo | sapo) compared at equal compute on the verifiable preset, over seeds.

For each seed (data, SFT, GRPO and evaluation seeds all set to it) this runs data-split and sft once with the
tiny-cpu-verifiable preset (GRPO scored by configs/rewards/arithmetic.py:exact_answer, no reward model), then
the GRPO stage once per policy loss from the same SFT model, each its own stage command (`kubealign ppo --set
ppo.policy_loss=X`; the preset's ppo.algorithm is grpo) with every other setting identical (iterations, batch,
group size, generation, learning rate, clip bounds: equal compute), then `kubealign evaluate` of each candidate
against the same SFT baseline. Per loss and seed it records:

* verified accuracy of the candidate and of the baseline on the held-out prompts (evaluate's
  fn/exact_answer/candidate and /baseline) and their difference, and GRPO's own held-out check before / after;
* KL of the candidate to the SFT model (evaluate's kl_to_baseline) and GRPO's eval KL after training;
* the GRPO stage's wall time (process start to exit, imports included; also its in-process wall_time_s), CPU
  seconds and peak RSS (as benchmarks/algorithms.py measures them), and the load average when it started;
* the rollout-trainer mismatch the stage logs each iteration (rollout_logprob_diff_mean / _max: the mean of
  the iterations' means, the largest max), the mean clip fraction, and any non-finite loss (a stage stopped
  by one, or a non-finite figure in its history).

Summaries per loss: mean and min / max over seeds of the accuracy gain, the candidate's accuracy and KL, and of
the wall and CPU time as a ratio to `ppo`'s within the same seed. The cores may be shared: before each GRPO
stage the harness waits (up to --max-wait s) for a 1-minute load average below 1.5; the losses of one seed
run back to back, in an order rotated from seed to seed. The record is rewritten after every seed.

  python benchmarks/policy_losses.py           # seeds 1234 1 2 -> results/policy-losses-tiny-cpu-verifiable.json
  python benchmarks/policy_losses.py --quick --out DIR       # smoke: 1 seed, 1 SFT epoch, 3 GRPO iterations
  python benchmarks/policy_losses.py --seeds 7 --losses ppo cispo --set ppo.ppo_epochs=2 --label try
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithms import git_revision, timed, wait_for_quiet  # noqa: E402
from demo_quality import kubealign  # noqa: E402
from train_throughput import machine  # noqa: E402
from verifiable_quality import METRIC, PRESET, SEEDED, demonstration_accuracy  # noqa: E402

HERE = Path(__file__).resolve().parent
LOSSES = ("ppo", "gspo", "cispo", "sapo")
QUICK = ("sft.num_train_epochs=1", "ppo.num_iterations=3", "evaluate.max_prompts=16")


def grpo_figures(result: dict) -> dict:
    """What one GRPO stage's result.json says of its run: held-out check, KL, mismatch, non-finite figures."""
    m, history = result["metrics"], result["history"]
    column = lambda key: [h[key] for h in history if key in h]  # noqa: E731
    rewards = column("reward_mean")
    diff_means, diff_maxes = column("rollout_logprob_diff_mean"), column("rollout_logprob_diff_max")
    finite = lambda v: not isinstance(v, float) or math.isfinite(v)  # noqa: E731
    bad = [f"{h['iteration']}:{k}" for h in history for k, v in h.items() if not finite(v)]
    return {
        "stage_wall_time_s": m.get("wall_time_s"),
        "check_accuracy_before_after": [m.get(f"{METRIC}/before"), m.get(f"{METRIC}/after")],
        "train_reward_first10_last10": [statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])],
        "grpo_kl_after": m["kl_after"],
        "clip_fraction_mean": statistics.fmean(column("clip_fraction")) if column("clip_fraction") else None,
        "rollout_logprob_diff_mean": statistics.fmean(diff_means) if diff_means else None,
        "rollout_logprob_diff_max": max(diff_maxes) if diff_maxes else None,
        "nonfinite_history": bad,
        "non_finite_loss": bool(bad),
    }


def train_loss(loss: str, d: dict[str, str], sets: list[str], work: Path, max_wait_s: float) -> dict:
    """One GRPO stage with ppo.policy_loss=LOSS, timed after a quiet load average."""
    args = [
        "ppo",
        "--prompts",
        d["split"],
        "--actor",
        d["sft"],
        "--output",
        str(work / loss),
        *sets,
        "--set",
        f"ppo.policy_loss={loss}",
    ]
    record = {**wait_for_quiet(max_wait_s=max_wait_s), **timed(args, work / f"{loss}.log")}
    if record["exit_code"] == 0:
        record.update(grpo_figures(json.loads((work / loss / "result.json").read_text())))
    else:  # a non-finite loss stops the stage with one line: "... actor loss is nan at iteration N ..."
        record["non_finite_loss"] = bool(re.search(r"\b(nan|inf)\b", record.get("error", "")))
    return record


def evaluate_loss(loss: str, d: dict[str, str], sets: list[str], work: Path) -> dict:
    out = work / f"eval-{loss}"
    args = [
        "evaluate",
        "--prompts",
        d["split"],
        "--baseline",
        d["sft"],
        "--candidate",
        str(work / loss),
        "--output",
        str(out),
        *sets,
    ]
    run = timed(args, work / f"eval-{loss}.log")
    if run["exit_code"] != 0:
        return {"evaluate": run}
    m = json.loads((out / "result.json").read_text())["metrics"]
    base, cand = m[f"{METRIC}/baseline"], m[f"{METRIC}/candidate"]
    return {
        "baseline_accuracy": base,
        "candidate_accuracy": cand,
        "accuracy_gain": cand - base,
        "kl_to_baseline": m["kl_to_baseline"],
        "candidate_length_mean": m["candidate_length_mean"],
        "prompts": m["prompts"],
        "evaluate_wall_s": run["wall_s"],
    }


def ratios_to_ppo(losses: dict[str, dict]) -> None:
    """wall_vs_ppo / cpu_vs_ppo of every loss of one seed (None without a finished ppo run), in place."""
    ppo = losses.get("ppo", {})
    for key, ratio in (("wall_s", "wall_vs_ppo"), ("cpu_s", "cpu_vs_ppo")):
        base = ppo.get(key) if ppo.get("exit_code") == 0 else None
        for r in losses.values():
            r[ratio] = r[key] / base if base and r.get("exit_code") == 0 else None


def one_seed(work: Path, seed: int, order: list[str], overrides: list[str], max_wait_s: float) -> dict:
    sets = ["--config", PRESET]
    sets += [a for o in [*(f"{k}={seed}" for k in SEEDED), "tracking.enabled=false", *overrides] for a in ("--set", o)]
    d = {name: str(work / name) for name in ("split", "sft")}
    shared = {
        "data-split": kubealign("data-split", "--output", d["split"], *sets),
        "sft": kubealign("sft", "--data", d["split"], "--output", d["sft"], *sets),
    }
    runs = {}
    for loss in order:
        runs[loss] = r = train_loss(loss, d, sets, work, max_wait_s)
        print(
            f"  seed {seed} {loss}: {r['wall_s']:.1f} s ({r['cpu_s']:.0f} CPU s), load {r['loadavg_at_start'][0]:.2f}"
            + (f"  FAILED: {r['error']}" if r["exit_code"] else ""),
            flush=True,
        )
    for loss in order:
        if runs[loss]["exit_code"] == 0:
            runs[loss].update(evaluate_loss(loss, d, sets, work))
    ratios_to_ppo(runs)
    sft = json.loads((work / "sft" / "result.json").read_text())["metrics"]
    # evaluate samples the baseline with the same seed for every candidate: one value per seed
    baseline = sorted({r["baseline_accuracy"] for r in runs.values() if "baseline_accuracy" in r})
    return {
        "seed": seed,
        "loss_order": order,
        "sft_data_accuracy": demonstration_accuracy(Path(d["split"])),
        "sft_eval_perplexity": sft.get("after_perplexity"),
        "shared_stage_wall_s": shared,
        "baseline_accuracies": baseline,
        "losses": runs,
    }


def spread(values: list[float | None]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "seeds": len(values)}


SUMMARIZED = (
    "accuracy_gain",
    "candidate_accuracy",
    "baseline_accuracy",
    "kl_to_baseline",
    "wall_s",
    "cpu_s",
    "wall_vs_ppo",
    "cpu_vs_ppo",
    "rollout_logprob_diff_mean",
    "rollout_logprob_diff_max",
    "clip_fraction_mean",
)


def summary(runs: list[dict], losses: list[str]) -> dict:
    """Per loss: mean / min / max over the seeds that finished (stage and evaluate) of each SUMMARIZED figure,
    and how many seeds failed or saw a non-finite loss."""
    out = {}
    for loss in losses:
        mine = [s["losses"][loss] for s in runs if loss in s["losses"]]
        ok = [r for r in mine if "accuracy_gain" in r]
        out[loss] = {
            **{key: spread([r.get(key) for r in ok]) for key in SUMMARIZED},
            "failed": len(mine) - len(ok),
            "non_finite_loss": sum(bool(r.get("non_finite_loss")) for r in mine),
        }
    return out


COLUMNS = (
    ("accuracy", "candidate_accuracy", ".0%"),
    ("gain over SFT", "accuracy_gain", "+.0%"),
    ("KL to SFT", "kl_to_baseline", ".2f"),
    ("wall (s)", "wall_s", ".1f"),
    ("wall / ppo's", "wall_vs_ppo", ".2f"),
    ("CPU / ppo's", "cpu_vs_ppo", ".2f"),
    ("rollout diff max", "rollout_logprob_diff_max", ".2g"),
)


def cell(figure: dict | None, fmt: str) -> str:
    """The mean, and (min to max) when more than one seed counts."""
    if figure is None:
        return "—"
    low, mean, high = (format(figure[k], fmt) for k in ("min", "mean", "max"))
    return mean if figure["seeds"] == 1 else f"{mean} ({low} to {high})"


def table(summaries: dict) -> str:
    """Markdown: per loss, the mean (min to max over seeds) of the main figures."""
    rows = [
        "| policy_loss | " + " | ".join(name for name, _, _ in COLUMNS) + " | failed / non-finite |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for loss, s in summaries.items():
        cells = [cell(s[key], fmt) for _, key, fmt in COLUMNS]
        rows.append(f"| {loss} | " + " | ".join(cells) + f" | {s['failed']} / {s['non_finite_loss']} |")
    return "\n".join(rows)


def ppo_settings(overrides: list[str]) -> dict:
    """The ppo section every loss ran with (policy_loss and seed aside): the equal-compute settings."""
    from kubealign.config import load_config

    ppo = load_config(PRESET, overrides).ppo.model_dump(mode="json")
    return {k: v for k, v in ppo.items() if k not in ("policy_loss", "seed")}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", help="default 1234 1 2 (--quick: 1234)")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    parser.add_argument("--label", help="the results file's name (default policy-losses-tiny-cpu-verifiable[-quick])")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder of the results file")
    parser.add_argument("--max-wait", type=float, help="most seconds to wait for a quiet load (default 300; --quick 0)")
    parser.add_argument("--quick", action="store_true", help="smoke: one seed, " + ", ".join(QUICK))
    args = parser.parse_args(argv)
    args.seeds = args.seeds or ([1234] if args.quick else [1234, 1, 2])
    args.overrides = [*(QUICK if args.quick else ()), *args.overrides]  # the user's own come last and win
    args.label = args.label or f"policy-losses-{PRESET}" + ("-quick" if args.quick else "")
    args.max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 300.0)
    return args


def main() -> None:
    args = parse()
    record = {
        "preset": PRESET,
        "command": " ".join(["python", *sys.argv]),
        "overrides": args.overrides,
        "losses": args.losses,
        "quick": args.quick,
        "ppo_settings": ppo_settings(args.overrides),
        "git": git_revision(),
        "machine": machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.label}.json"
    for i, seed in enumerate(args.seeds):
        order = args.losses[i % len(args.losses) :] + args.losses[: i % len(args.losses)]
        print(f"seed {seed}: policy losses in order {' '.join(order)}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            record["runs"].append(one_seed(Path(tmp), seed, order, args.overrides, args.max_wait))
        record["summary"] = summary(record["runs"], args.losses)
        record["table"] = table(record["summary"])
        out.write_text(json.dumps(record, indent=2) + "\n")  # what ran so far survives a later failure
    print(record["table"])
    print(f"written to {out}")


if __name__ == "__main__":
    main()
