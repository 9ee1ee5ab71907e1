"""Does tool use visibly pay? The tiny-cpu-tools pipeline, stage by stage, over seeds (issue 58).

For each seed (data, SFT, GRPO and evaluation seeds all set to it) this runs data-split -> sft -> ppo (GRPO in
turns with the `add` tool, scored by configs/rewards/tool_arithmetic.py:final_answer) -> evaluate -> promote
with the tiny-cpu-tools preset (verifiable_quality.py's stages and figures) and records besides, for SFT
(baseline) and GRPO (candidate) on the held-out prompts at evaluate's sampling settings: the share of answers
that called the tool, the share of calls that were malformed and the turns per answer.

  python benchmarks/tools_quality.py   # seeds 1234 1 2 -> results/tools-quality-tiny-cpu-tools.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verifiable_quality import one_seed, seeds  # noqa: E402

PRESET = "tiny-cpu-tools"
TURNS = ("tool_call_rate", "malformed_call_rate", "turns_mean")


def tools_seed(work: Path, seed: int, overrides: list[str]) -> dict:
    found = one_seed(work, seed, overrides, PRESET, "fn/final_answer")
    ev = found.pop("evaluation")
    return {**found, **{f"{k}/{m}": ev[f"{k}/{m}"] for k in TURNS for m in ("baseline", "candidate")}}


def describe(r: dict) -> str:
    return (
        f"right {r['baseline_accuracy']:.2f} (SFT) -> {r['candidate_accuracy']:.2f} (GRPO) on {r['prompts']} prompts; "
        f"tool calls {r['tool_call_rate/baseline']:.2f} -> {r['tool_call_rate/candidate']:.2f}; "
        f"KL {r['kl_to_baseline']:.2f}; champion {r['champion']}; {r['total_wall_s']:.0f} s"
    )


if __name__ == "__main__":
    seeds(PRESET, f"tools-quality-{PRESET}", describe, tools_seed)
