"""Do verifiable rewards visibly work? The tiny-cpu-verifiable pipeline, stage by stage, over seeds.

For each seed (data, SFT, GRPO and evaluation seeds all set to it) this runs data-split -> sft -> ppo (GRPO,
scored by configs/rewards/arithmetic.py:exact_answer, no reward model) -> evaluate -> promote with the
tiny-cpu-verifiable preset and records:

* the share of right answers in the SFT demonstrations (recomputed from the prompts' operands);
* verified accuracy of SFT (baseline) and GRPO (candidate) samples at the evaluation's sampling settings
  (evaluate's fn/exact_answer/baseline and /candidate), and on GRPO's own held-out check before / after;
* KL of the candidate to the SFT model, the stage wall times, and whether the gate (promote.metric
  fn/exact_answer/candidate) made the candidate `champion`.

  python benchmarks/verifiable_quality.py   # seeds 1234 1 2 -> results/verifiable-quality-tiny-cpu-verifiable.json
  python benchmarks/verifiable_quality.py --seeds 7 --set ppo.num_iterations=40 --label try
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_quality import kubealign  # noqa: E402  (one stage command, timed: the main demo's benchmark's)
from train_throughput import machine  # noqa: E402

PRESET = "tiny-cpu-verifiable"
HERE = Path(__file__).resolve().parent
SEEDED = ("data.seed", "sft.seed", "ppo.seed", "evaluate.seed")
METRIC = "fn/exact_answer"


def demonstration_accuracy(split: Path) -> float:
    """Share of the SFT train demonstrations whose answer is the sum of the prompt's operands."""
    from kubealign.data import arithmetic, phases

    rows = phases.load(split, "phase1_sft")["train"]
    right = [int(c) == sum(arithmetic.operands(p)) for p, c in zip(rows["prompt"], rows["chosen"], strict=True)]
    return sum(right) / len(right)


def one_seed(work: Path, seed: int, overrides: list[str], preset: str = PRESET, metric: str = METRIC) -> dict:
    """The preset's stages for one seed; the figures every checked-answer preset shares (tools_quality.py adds
    its own from the evaluation, `evaluation`)."""
    sets = ["--config", preset]
    sets += [a for o in [*(f"{k}={seed}" for k in SEEDED), *overrides] for a in ("--set", o)]
    d = {name: str(work / name) for name in ("split", "sft", "grpo", "eval", "promote")}
    walls = {
        "data-split": kubealign("data-split", "--output", d["split"], *sets),
        "sft": kubealign("sft", "--data", d["split"], "--output", d["sft"], *sets),
        "grpo": kubealign("ppo", "--prompts", d["split"], "--actor", d["sft"], "--output", d["grpo"], *sets),
        "evaluate": kubealign(
            "evaluate",
            "--prompts",
            d["split"],
            "--baseline",
            d["sft"],
            "--candidate",
            d["grpo"],
            "--output",
            d["eval"],
            *sets,
        ),
        "promote": kubealign(
            "promote", "--evaluation", d["eval"], "--model-dir", d["grpo"], "--output", d["promote"], *sets
        ),
    }
    read = lambda name: json.loads((work / name / "result.json").read_text())  # noqa: E731
    ev, grpo, sft, promote = read("eval")["metrics"], read("grpo"), read("sft"), read("promote")
    history = grpo["history"]
    return {
        "seed": seed,
        "sft_eval_perplexity": sft["metrics"]["after_perplexity"],
        "baseline_accuracy": ev[f"{metric}/baseline"],
        "candidate_accuracy": ev[f"{metric}/candidate"],
        "prompts": ev["prompts"],
        "kl_to_baseline": ev["kl_to_baseline"],
        "candidate_length_mean": ev["candidate_length_mean"],
        "grpo_check_accuracy_before_after": [grpo["metrics"][f"{metric}/before"], grpo["metrics"][f"{metric}/after"]],
        "grpo_train_reward_first10_last10": [
            sum(h["reward_mean"] for h in history[:10]) / len(history[:10]),
            sum(h["reward_mean"] for h in history[-10:]) / len(history[-10:]),
        ],
        "grpo_kl_after": grpo["metrics"]["kl_after"],
        "champion": promote["aliases"].get("champion") == promote["version"],
        "stage_wall_s": walls,
        "total_wall_s": sum(walls.values()),
        "evaluation": ev,
    }


def seeds(preset: str, label: str, describe: Callable[[dict], str], measure: Callable[..., dict]) -> None:
    """The benchmark's command line: --seeds, --set, --label; a record written after every seed."""
    parser = argparse.ArgumentParser(description=(sys.modules["__main__"].__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra config overrides")
    parser.add_argument("--label", default=label)
    args = parser.parse_args()
    runs: list[dict] = []
    out = HERE / "results" / f"{args.label}.json"
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(measure(Path(tmp), seed, args.overrides))
        print(f"seed {seed}: {describe(runs[-1])}")
        # written after every seed: a run cut short still records the seeds it finished
        record = {"preset": preset, "overrides": args.overrides, "runs": runs, "machine": machine()}
        out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")


def verifiable_seed(work: Path, seed: int, overrides: list[str]) -> dict:
    found = one_seed(work, seed, overrides)
    found.pop("evaluation")
    return {**found, "sft_data_accuracy": demonstration_accuracy(work / "split")}


def main() -> None:
    seeds(
        PRESET,
        f"verifiable-quality-{PRESET}",
        lambda r: (
            f"right {r['sft_data_accuracy']:.2f} (SFT data) -> {r['baseline_accuracy']:.2f} (SFT) -> "
            f"{r['candidate_accuracy']:.2f} (GRPO) on {r['prompts']} prompts; KL {r['kl_to_baseline']:.2f}; "
            f"champion {r['champion']}; {r['total_wall_s']:.0f} s"
        ),
        verifiable_seed,
    )


if __name__ == "__main__":
    main()
