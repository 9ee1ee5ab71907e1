"""Does RLHF visibly work on the embedded default? The tiny-cpu pipeline, stage by stage, over seeds.

For each seed (data, SFT, reward, PPO and evaluation seeds all set to it) this runs data-split -> sft ->
reward -> ppo -> evaluate -> promote with the tiny-cpu preset and records what the synthetic task's own
grammar (`kubealign.data.synthetic.grade`) says of the samples, next to the evaluation's metrics:

* the share of the preferred behaviour (a courteous, on-topic answer) in the SFT demonstrations;
* well-formed / preferred rates of SFT and PPO samples at the evaluation's sampling settings;
* win-rate of PPO over SFT with its 95 % bootstrap lower bound, KL to the SFT model, the adaptive KL
  target, and whether the gate made the candidate `champion`.

  python benchmarks/demo_quality.py                      # seeds 1234 1 2 -> results/demo-quality-tiny-cpu.json
  python benchmarks/demo_quality.py --seeds 7 --set ppo.num_iterations=40 --label try
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import machine  # noqa: E402

from kubealign.config import load_config  # noqa: E402

HERE = Path(__file__).resolve().parent
SEEDED = ("data.seed", "sft.seed", "reward.seed", "ppo.seed", "evaluate.seed")


def kubealign(*args: str) -> float:
    """Run one stage command; returns its wall time in seconds."""
    exe = str(Path(sys.executable).parent / "kubealign")
    started = time.perf_counter()
    subprocess.run([exe, *args], check=True, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def demonstration_share(split: Path) -> float:
    """Share of the SFT train demonstrations that show the preferred behaviour."""
    from kubealign.data import phases, synthetic

    rows = phases.load(split, "phase1_sft")["train"]
    verdicts = [synthetic.grade(p, c).preferred for p, c in zip(rows["prompt"], rows["chosen"], strict=True)]
    return sum(verdicts) / len(verdicts)


def one_seed(work: Path, seed: int, overrides: list[str]) -> dict:
    sets = [a for o in [*(f"{k}={seed}" for k in SEEDED), *overrides] for a in ("--set", o)]
    d = {name: str(work / name) for name in ("split", "sft", "rm", "ppo", "eval", "promote")}
    walls = {
        "data-split": kubealign("data-split", "--output", d["split"], *sets),
        "sft": kubealign("sft", "--data", d["split"], "--output", d["sft"], *sets),
        "reward": kubealign("reward", "--data", d["split"], "--output", d["rm"], *sets),
        "ppo": kubealign(
            "ppo", "--prompts", d["split"], "--actor", d["sft"], "--critic", d["rm"], "--output", d["ppo"], *sets
        ),
        "evaluate": kubealign(
            "evaluate",
            "--prompts",
            d["split"],
            "--baseline",
            d["sft"],
            "--candidate",
            d["ppo"],
            "--reward",
            d["rm"],
            "--output",
            d["eval"],
            *sets,
        ),
        "promote": kubealign(
            "promote", "--evaluation", d["eval"], "--model-dir", d["ppo"], "--output", d["promote"], *sets
        ),
    }
    read = lambda name: json.loads((work / name / "result.json").read_text())  # noqa: E731
    ev, ppo, rm, sft, promote = read("eval")["metrics"], read("ppo"), read("rm"), read("sft"), read("promote")
    keys = (
        "baseline_well_formed_rate",
        "candidate_well_formed_rate",
        "baseline_preferred_rate",
        "candidate_preferred_rate",
        "baseline_on_topic_rate",
        "candidate_on_topic_rate",
        "win_rate",
        "win_rate_lower_bound",
        "tie_rate",
        "kl_to_baseline",
        "baseline_reward_mean",
        "candidate_reward_mean",
        "prompts",
    )
    return {
        "seed": seed,
        "sft_data_preferred_share": demonstration_share(work / "split"),
        "sft_eval_perplexity": sft["metrics"]["after_perplexity"],
        "rm_eval_accuracy": rm["metrics"]["after_accuracy"],
        **{k: ev[k] for k in keys},
        "ppo_kl_after": ppo["metrics"]["kl_after"],
        "ppo_kl_target": load_config(None, overrides).ppo.kl_target,
        "ppo_kl_last10_mean": sum(h["kl"] for h in ppo["history"][-10:]) / len(ppo["history"][-10:]),
        "ppo_kl_coef_first_last": [ppo["history"][0]["kl_coef"], ppo["history"][-1]["kl_coef"]],
        "champion": promote["aliases"].get("champion") == promote["version"],
        "stage_wall_s": walls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    parser.add_argument("--label", default="demo-quality-tiny-cpu")
    args = parser.parse_args()
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one_seed(Path(tmp), seed, args.overrides))
        r = runs[-1]
        print(
            f"seed {seed}: preferred {r['sft_data_preferred_share']:.2f} (SFT data) -> "
            f"{r['baseline_preferred_rate']:.2f} (SFT) -> {r['candidate_preferred_rate']:.2f} (PPO); well-formed "
            f"{r['baseline_well_formed_rate']:.2f} -> {r['candidate_well_formed_rate']:.2f}; win-rate "
            f"{r['win_rate']:.2f} (lower bound {r['win_rate_lower_bound']:.2f}); KL {r['kl_to_baseline']:.2f} "
            f"(PPO {r['ppo_kl_after']:.2f}, target {r['ppo_kl_target']}); champion {r['champion']}"
        )
    record = {"preset": "tiny-cpu", "overrides": args.overrides, "runs": runs, "machine": machine()}
    out = HERE / "results" / f"{args.label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
