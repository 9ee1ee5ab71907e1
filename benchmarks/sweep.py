"""A sweep in one pipeline run against separate runs (issue 41): a 4-point DPO beta sweep plus ppo and grpo at
their defaults, on the embedded default (tiny-cpu), each side from an empty kfp.local cache of its own
(KUBEALIGN_CACHE_DIR pointed at a new directory, so the tiny base models are built once on each side too):

* one run: `kubealign run --cache --set pipeline.candidates=[...]` (six candidates, one DAG);
* six runs: `kubealign run --cache` with one candidate each, one after the other (the first computes
  data-split, SFT and the reward model; the others take them from the cache).

Per side: the wall time of each `kubealign run` process and which tasks ran or came from the cache. From the
one run: the leaderboard (rank, settings, win-rate with its interval, reward, KL, on the Pareto front), the
leader and whether it became champion, and its frontier picture, copied to docs/images/sweep-frontier.png
for docs/stages.md.

  python benchmarks/sweep.py                  # -> results/sweep-tiny-cpu.json, docs/images/sweep-frontier.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routes import run  # noqa: E402
from train_throughput import machine  # noqa: E402

HERE = Path(__file__).resolve().parent
BETAS = (0.01, 0.05, 0.1, 0.3)
SPECS = [
    *({"algorithm": "dpo", "name": f"dpo-beta-{str(b).replace('.', 'p')}", "set": {"dpo.beta": b}} for b in BETAS),
    {"algorithm": "ppo"},
    {"algorithm": "grpo"},
]
# what a person writes: the grid shorthand (expands to the four named dpo candidates above)
SWEEP = "pipeline.candidates=[{route: dpo, sweep: {dpo.beta: [0.01, 0.05, 0.1, 0.3]}}, {route: ppo}, {route: grpo}]"


def board(output: Path) -> dict:
    """The one run's comparison: its rows, leader, front and verdict, and whether the leader became champion."""
    index = json.loads((output / "run.json").read_text())
    comparison = json.loads((Path(index["stages"]["compare"]["dir"]) / "result.json").read_text())
    settings = {c["name"]: c["set"] for c in comparison["candidates"]}
    rows = []
    for standing in comparison["standings"]:
        name = standing["route"]
        m = comparison["evaluation_metrics"][name]
        promoted = json.loads((Path(index["stages"][f"promote-{name}"]["dir"]) / "result.json").read_text())
        rows.append(
            {
                "rank": standing["rank"],
                "candidate": name,
                "settings": settings[name],
                "win_rate": m["win_rate"],
                "win_rate_interval": [m["win_rate_lower_bound"], m["win_rate_upper_bound"]],
                "candidate_reward_mean": m["candidate_reward_mean"],
                "baseline_reward_mean": m["baseline_reward_mean"],
                "kl_to_baseline": m["kl_to_baseline"],
                "on_front": name in comparison["front"],
                "champion": promoted["aliases"].get("champion") == promoted["version"],
                "behind": standing["why"],
            }
        )
    picture = Path(index["stages"]["compare"]["dir"]) / "frontier.png"
    return {"rows": rows, "leader": comparison["leader"], "front": comparison["front"], "picture": str(picture)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="tiny-cpu")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="kubealign-sweep-") as tmp:
        work = Path(tmp)
        one = run([SWEEP], work / "one", work / "cache-one")
        result_board = board(work / "one")
        picture = HERE.parent / "docs" / "images" / "sweep-frontier.png"
        picture.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(result_board.pop("picture"), picture)
        singles = {}
        for spec in SPECS:
            name = spec.get("name") or spec["algorithm"]
            sets = [f"pipeline.candidates=[{json.dumps(spec)}]"]
            singles[name] = run(sets, work / f"single-{name}", work / "cache-six")
    six_wall = sum(s["wall_s"] for s in singles.values())
    result = {
        "harness": "benchmarks/sweep.py",
        "started": started,
        "machine": machine(),
        "loadavg_at_end": list(os.getloadavg()),
        "sweep": SWEEP,
        "one_run_six_candidates": one,
        "six_single_candidate_runs": singles,
        "six_runs_wall_s": round(six_wall, 1),
        "ratio_six_runs_to_one": round(six_wall / one["wall_s"], 2),
        "shared_stages_ran": {
            "one_run": [t for t in ("data-split", "sft", "reward") if t in one["ran"]],
            "six_runs": {n: [t for t in ("data-split", "sft", "reward") if t in s["ran"]] for n, s in singles.items()},
        },
        "leaderboard": result_board,
        "picture": "docs/images/sweep-frontier.png",
    }
    path = HERE / "results" / f"sweep-{args.label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"one run, six candidates: {one['wall_s']} s; six single-candidate runs: {six_wall:.1f} s "
        f"(x{result['ratio_six_runs_to_one']}); leader {result_board['leader']} -> {path}"
    )


if __name__ == "__main__":
    main()
