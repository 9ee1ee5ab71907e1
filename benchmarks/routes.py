"""Four routes in one pipeline run against four single-route runs, and the leaderboard over seeds (issue 28).

Timing, on the embedded default (tiny-cpu), each side from an empty kfp.local cache of its own
(KUBEALIGN_CACHE_DIR pointed at a new directory, so the tiny base models are built once on each side too):

* one run: `kubealign run --cache --set 'pipeline.candidates=[{route: ppo}, ..., {route: dpo}]'`;
* four runs: `kubealign run --cache --set 'pipeline.candidates=[{route: R}]'` for R = ppo, grpo, rloo,
  dpo, one after the other (the first computes data-split, SFT and the reward model; the others take them
  from the cache).

Per side: the wall time of each `kubealign run` process, and which tasks ran and which came from the cache
(from its progress lines). The shared stages must run once on either side; the difference is what the
single-route runs repeat (their processes, the pipeline's start) against the comparison task.

Leaderboard: the four-route run at seeds 1234, 1, 2 (data, SFT, reward, PPO, DPO and evaluation seeds all set
to it; the 1234 run is the timed one): each route's rank, win-rate with its 95 % bootstrap interval, mean
reward, KL to SFT, and whether the leader became champion.

  python benchmarks/routes.py                 # -> results/routes-tiny-cpu.json
  python benchmarks/routes.py --seeds 1234 --label try
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
from demo_quality import SEEDED  # noqa: E402
from train_throughput import machine  # noqa: E402

HERE = Path(__file__).resolve().parent
ROUTES = ("ppo", "grpo", "rloo", "dpo")
SEEDS = (*SEEDED, "dpo.seed")


def candidates(routes: tuple[str, ...] | list[str]) -> str:
    """The --set override of one candidate per route: pipeline.candidates=[{route: ppo}, ...]."""
    return "pipeline.candidates=[" + ", ".join(f"{{route: {r}}}" for r in routes) + "]"


def run(sets: list[str], output: Path, cache: Path) -> dict:
    """One `kubealign run --cache` process: wall time, and the tasks that ran / came from the cache."""
    exe = str(Path(sys.executable).parent / "kubealign")
    args = [exe, "run", "--cache", "--output", str(output), *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "TQDM_DISABLE": "1", "KUBEALIGN_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    done = subprocess.run(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout[-3000:]}")
    lines = done.stdout.splitlines()
    states = [line.split()[:2] for line in lines[: lines.index("")] if len(line.split()) >= 2]
    return {
        "wall_s": round(wall, 1),
        "ran": [name for name, state in states if state == "done"],
        "cached": [name for name, state in states if state == "cached"],
        "pipeline_wall_s": round(json.loads((output / "run.json").read_text())["wall_time_s"], 1),
    }


def leaderboard(output: Path) -> list[dict]:
    index = json.loads((output / "run.json").read_text())
    comparison = json.loads((Path(index["stages"]["compare"]["dir"]) / "result.json").read_text())
    rows = []
    for standing in comparison["standings"]:
        route = standing["candidate"]
        m = json.loads((Path(index["stages"][f"evaluate-{route}"]["dir"]) / "result.json").read_text())["metrics"]
        promoted = json.loads((Path(index["stages"][f"promote-{route}"]["dir"]) / "result.json").read_text())
        rows.append(
            {
                "rank": standing["rank"],
                "route": route,
                "win_rate": m["win_rate"],
                "win_rate_interval": [m["win_rate_lower_bound"], m["win_rate_upper_bound"]],
                "candidate_reward_mean": m["candidate_reward_mean"],
                "baseline_reward_mean": m["baseline_reward_mean"],
                "kl_to_baseline": m["kl_to_baseline"],
                "champion": promoted["aliases"]["champion"] == promoted["version"],
                "behind": standing["why"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1, 2])
    parser.add_argument("--label", default="tiny-cpu")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="kubealign-routes-") as tmp:
        work = Path(tmp)
        timed_seed = args.seeds[0]
        seeded = [f"{key}={timed_seed}" for key in SEEDS]
        one = run([*seeded, candidates(ROUTES)], work / "one", work / "cache-one")
        singles = {r: run([*seeded, candidates([r])], work / f"single-{r}", work / "cache-four") for r in ROUTES}
        four_wall = sum(s["wall_s"] for s in singles.values())
        boards = {str(timed_seed): leaderboard(work / "one")}
        for seed in args.seeds[1:]:
            sets = [*(f"{key}={seed}" for key in SEEDS), candidates(ROUTES)]
            run(sets, work / f"seed-{seed}", work / "cache-one")
            boards[str(seed)] = leaderboard(work / f"seed-{seed}")
    wins = {r: sum(board[0]["route"] == r for board in boards.values()) for r in ROUTES}
    result = {
        "harness": "benchmarks/routes.py",
        "started": started,
        "machine": machine(),
        "loadavg_at_end": list(os.getloadavg()),
        "timing_seed": timed_seed,
        "one_run_four_routes": one,
        "four_single_route_runs": singles,
        "four_runs_wall_s": round(four_wall, 1),
        "ratio_four_runs_to_one": round(four_wall / one["wall_s"], 2),
        "shared_stages_ran": {
            "one_run": [t for t in ("data-split", "sft", "reward") if t in one["ran"]],
            "four_runs": {r: [t for t in ("data-split", "sft", "reward") if t in s["ran"]] for r, s in singles.items()},
        },
        "leaderboards": boards,
        "leader_count": wins,
    }
    path = HERE / "results" / f"routes-{args.label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"one run, four routes: {one['wall_s']} s; four single-route runs: {four_wall:.1f} s "
        f"(x{result['ratio_four_runs_to_one']}); leaders {wins} -> {path}"
    )


if __name__ == "__main__":
    main()
