"""PPO iteration time split (generation / experience passes / training), samples/s, and the reward and
KL it reaches, on the tiny CPU preset. Results go to benchmarks/results/<label>.json with the machine.

  python benchmarks/ppo_iteration.py                 # data-split -> sft (6 epochs) -> reward -> ppo (30 iterations)
  python benchmarks/ppo_iteration.py --iterations 60 --set ppo.actor_zero_stage=3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
    parser.add_argument("--label", default="ppo-tiny-opt-cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        kubealign("data-split", "--output", str(work / "split"))
        kubealign("sft", "--data", str(work / "split"), "--output", str(work / "sft"),
                  "--set", f"sft.num_train_epochs={args.sft_epochs}")  # fmt: skip
        kubealign("reward", "--data", str(work / "split"), "--output", str(work / "rm"))
        extra = [a for o in args.overrides for a in ("--set", o)]
        kubealign("ppo", "--prompts", str(work / "split"), "--actor", str(work / "sft"), "--critic", str(work / "rm"),
                  "--output", str(work / "ppo"), "--set", f"ppo.num_iterations={args.iterations}", *extra)  # fmt: skip
        result = json.loads((work / "ppo" / "result.json").read_text())
    history = result["history"][1:] or result["history"]  # the first iteration includes one-time warm-up
    mean = {k: sum(h[k] for h in history) / len(history) for k in
            ("generation_time_s", "experience_time_s", "training_time_s", "samples_per_s")}  # fmt: skip
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


if __name__ == "__main__":
    main()
