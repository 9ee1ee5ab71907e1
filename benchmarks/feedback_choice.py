"""Which labels buy the better online gate: the served pairs where the automatic judges disagree first, or the same
number drawn at random (issue 79's second goal), measured on the pairs the rehearsal's canaries really served.

The rehearsal (benchmarks/feedback_rounds.py --keep DIR) keeps each round's judge output: the champion's and the
canary's answers to the same held-out prompts, each reward model's scores and the online figures. On each of those
served pools this replays a round's people many times over, through the code a round runs:

* the push's choice of `budget` pairs (kubealign.feedback.served.served_tasks), the draw's seed as evaluate.seed,
  in four arms: "disagree" (feedback.random_share 0.25, the rest by kubealign.feedback.choice.priority: where the
  judges' probabilities are furthest apart), "half" (0.5), "random" (1.0) and "unsure" (0.25, the rest by the first
  rule: the judges' mean probability nearest 0.5, where they split or all are unsure);
* the scripted person of the rehearsal annotating them (tests/feedback/standin.annotate: its hidden preference, 10 %
  noise, 10 % skips, a pair it finds equally good skipped), the draw's seed;
* the pull's figures (kubealign.feedback.agreement: each judge's agreement with people, people's weighted win-rate);
* the online gate on the pool's own figures with those (kubealign.serving.verdict.decide, the rehearsal's
  JUDGE_SETTINGS: promote.guards.min_judge_agreement 0.6), in two forms (GATES): "people", with people's own check
  (canary.min_human_win_rate 0.5) as in the rehearsal, and "judges", the trusted judges alone.

Every arm uses the same seeds. A verdict is **right** when it promotes a canary the person prefers over the whole
pool (noise free: its share of the pairs, ties half, above 0.5) or keeps the champion otherwise. A judge's trust is
**right** when the gate trusts it exactly when its agreement with the noise-free person over the whole pool (the
pairs it leaned on and the person did not find level) reaches the bar. Recorded per arm and budget: the share of
right verdicts (per pool, and their mean: each pool alike), the share of right trust calls per judge, people's
weighted win-rate's mean absolute error against the pool's truth; and each arm against the random one, paired by
pool.

  python benchmarks/feedback_choice.py   # the recorded pools -> results/feedback-choice-tiny-cpu.{json,png}
  # new pools: the rehearsal keeping them, then the replay on them
  python benchmarks/feedback_rounds.py --seeds 0 1 2 3 4 --arms disagree --label feedback-rounds-pools --keep DIR
  python benchmarks/feedback_choice.py --pools DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from feedback_rounds import JUDGE_SETTINGS, PEOPLE, SETTINGS, provenance, truth  # noqa: E402

BAR = 0.6  # promote.guards.min_judge_agreement in JUDGE_SETTINGS
# the served pools of the recorded run: 5 seeds x 3 rounds of the rehearsal (answers.json and result.json of each)
POOLS = HERE / "results" / "feedback-choice-pools.tar.gz"
MODEL = "kubealign-actor"
# feedback.random_share of each arm, and the priority its certain pairs are taken by: the product's
# (kubealign.feedback.choice.priority: how far apart the judges are), or the first rule's, kept here to compare
ARMS = {"disagree": (0.25, None), "half": (0.5, None), "random": (1.0, None), "unsure": (0.25, "unsure")}
# the gates a draw's figures are decided by: the rehearsal's (people's own check beside the judges they trust), and
# the judges alone (people's choices only decide which judge is trusted: all distrusted, the champion stays)
GATES = {
    "people": JUDGE_SETTINGS,
    "judges": [s for s in JUDGE_SETTINGS if not s.startswith("canary.min_human_win_rate")],
}


def unsure(probabilities: dict[str, float]) -> float:
    """The first rule's priority: 4 p (1 - p) of the judges' mean probability p (1.0 with no judge): a pair where
    the judges split ranks with one where they all are unsure."""
    if not probabilities:
        return 1.0
    p = sum(probabilities.values()) / len(probabilities)
    return 4.0 * p * (1.0 - p)


@contextlib.contextmanager
def rule(name: str | None) -> Iterator[None]:
    """The push's priority for the arm: the product's (None) or the first rule's ("unsure")."""
    from kubealign.feedback import choice

    kept = choice.priority
    choice.priority = unsure if name == "unsure" else kept
    try:
        yield
    finally:
        choice.priority = kept


class Pool(NamedTuple):
    where: Path
    rows: list[dict[str, Any]]  # answers.json: the served pairs
    online: dict[str, float]  # the judge's online figures, no agreement among them
    share: float  # the person's noise-free preference for the canary over the pool (ties half)
    agreement: dict[str, float]  # each judge's noise-free agreement with the person over the pool


def pools(found: Path, prefer: Any) -> list[Pool]:
    """Every judge output under `found` (a folder with answers.json and result.json), with its truths."""
    from kubealign.feedback import served

    out = []
    for answers in sorted(found.rglob("answers.json")):
        rows, result = served.read_judged(answers.parent)
        online = {k: v for k, v in result["metrics"].items() if "/" not in k and not k.startswith("agreement_")}
        agreed: dict[str, list[int]] = {}
        for row in rows:
            champion, canary = (prefer(row["prompt"], row[w]["text"] or "") for w in ("champion", "canary"))
            if canary == champion or row["champion"]["text"] == row["canary"]["text"]:
                continue
            for judge, p in served.probabilities(row).items():
                if p != 0.5:
                    count = agreed.setdefault(judge, [0, 0])
                    count[0] += (p > 0.5) == (canary > champion)
                    count[1] += 1
        truths = {judge: a / n for judge, (a, n) in agreed.items()}
        out.append(Pool(answers.parent, rows, online, truth(rows, prefer)["canary_share"], truths))
    return out


def one_draw(pool: Pool, gates: dict[str, Any], share: float, budget: int, seed: int, prefer: Any) -> dict[str, Any]:
    """One round's people on `pool`: the push's choice, the scripted person, the pull's figures, each gate (GATES)
    deciding on them."""
    from kubealign.feedback import agreement, served
    from kubealign.serving.verdict import HumanFeedback, decide
    from tests.feedback.standin import annotate

    tasks = served.served_tasks(pool.where, MODEL, budget, share, seed, 1).tasks
    for number, task in enumerate(tasks, 1):
        task.update(id=number, annotations=[])
    annotate(tasks, prefer, noise=0.1, skip=0.1, seed=seed, skip_level=True)
    decided = agreement.decisions(tasks)
    figures = agreement.figures(agreement.agreements(decided))
    rate = agreement.weighted_win_rate(decided, "challenger")
    human = HumanFeedback(rate, len(decided), "replayed") if decided and rate == rate else None
    canary = {"error_rate": pool.online.get("error_rate", 0.0), "latency_p95_s": 0.0}
    pairs = int(pool.online["prompts"])
    right, lines = {}, []
    for gate, config in gates.items():
        promoted, lines = decide({**pool.online, **figures}, pairs, canary, config.promote, config.canary, human)
        right[gate] = promoted == (pool.share > 0.5)
    # the trust calls are the same in every gate (promote.guards.min_judge_agreement)
    trusted = {
        j: not any(line.startswith("not trusted") and f"[{j} " in line for line in lines) for j in pool.agreement
    }
    return {
        "right": right,
        "trust_right": {j: trusted[j] == (pool.agreement[j] >= BAR) for j in pool.agreement},
        "people_error": abs(rate - pool.share) if human else None,
    }


def measure(found: list[Pool], gates: dict[str, Any], arm: str, budget: int, draws: int, prefer: Any) -> dict[str, Any]:
    """An arm at a budget over every pool: each gate's share of right verdicts (per pool, and their mean), the share
    of right trust calls per judge, and people's weighted win-rate's mean absolute error."""
    share, name = ARMS[arm]
    per_pool: dict[str, list[float]] = {gate: [] for gate in gates}
    trust: dict[str, list[int]] = {}
    errors = []
    with rule(name):
        for pool in found:
            got = [one_draw(pool, gates, share, budget, seed, prefer) for seed in range(draws)]
            for g in got:
                for judge, ok in g["trust_right"].items():
                    trust.setdefault(judge, []).append(ok)
            errors += [g["people_error"] for g in got if g["people_error"] is not None]
            for gate in gates:
                per_pool[gate].append(sum(g["right"][gate] for g in got) / len(got))
    return {
        "right": {gate: sum(v) / len(v) for gate, v in per_pool.items()},
        "trust_right": {j: sum(v) / len(v) for j, v in trust.items()},
        "people_mean_abs_error": sum(errors) / len(errors) if errors else math.nan,
        "per_pool": per_pool,
    }


def against_random(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each arm against the random one at each budget and gate, paired by pool (the same seeds): the mean difference
    in right verdicts and the pools where the arm did better, the same, worse."""
    out: dict[str, dict[str, Any]] = {}
    for arm, budgets in results.items():
        if arm == "random":
            continue
        for budget, got in budgets.items():
            for gate, mine in got["per_pool"].items():
                base = results["random"][budget]["per_pool"][gate]
                diff = [a - b for a, b in zip(mine, base, strict=True)]
                out.setdefault(arm, {}).setdefault(budget, {})[gate] = {
                    "mean_difference": sum(diff) / len(diff),
                    "pools_better": sum(d > 0 for d in diff),
                    "pools_same": sum(d == 0 for d in diff),
                    "pools_worse": sum(d < 0 for d in diff),
                }
    return out


def picture(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = record["budgets"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm in record["arms"]:
        got = [record["results"][arm][str(b)] for b in budgets]
        for ax, gate in zip(axes, GATES, strict=False):
            ax.plot(budgets, [g["right"][gate] for g in got], marker="o", label=arm)
        axes[2].plot(budgets, [g["people_mean_abs_error"] for g in got], marker="o", label=arm)
    for ax, gate in zip(axes, GATES, strict=False):
        title = {"people": "gate: people's check + trusted judges", "judges": "gate: trusted judges alone"}[gate]
        ax.set(xlabel="labels a round (feedback.budget)", ylabel="right verdicts", title=title)
    axes[2].set(xlabel="labels a round (feedback.budget)", ylabel="mean |error|", title="people's weighted win-rate")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(record['pools'])} served pools, {record['draws']} draws each; the same seeds in every arm")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pools", type=Path, default=POOLS, help="feedback_rounds.py --keep's folder, or a .tar.gz of one"
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 12, 16, 24])
    parser.add_argument("--draws", type=int, default=200, help="rounds of people replayed per pool, arm and budget")
    parser.add_argument("--person", choices=sorted(PEOPLE), default="opener")
    parser.add_argument("--label", default="feedback-choice-tiny-cpu")
    args = parser.parse_args()
    prefer = PEOPLE[args.person]
    with tempfile.TemporaryDirectory(prefix="pools-") as tmp:
        where = args.pools
        if where.is_file():
            with tarfile.open(where) as packed:
                packed.extractall(tmp, filter="data")
            where = Path(tmp)
        found = pools(where, prefer)
        if not found:
            raise SystemExit(f"{args.pools}: no judge output (answers.json) under it")
        run(args, found, where, prefer)


def run(args: argparse.Namespace, found: list[Pool], where: Path, prefer: Any) -> None:
    from kubealign.config import load_config

    gates = {gate: load_config("tiny-cpu", [*SETTINGS, *sets]) for gate, sets in GATES.items()}
    results: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        for budget in args.budgets:
            got = measure(found, gates, arm, budget, args.draws, prefer)
            results.setdefault(arm, {})[str(budget)] = got
            right = ", ".join(f"{gate} {v:.3f}" for gate, v in got["right"].items())
            error = got["people_mean_abs_error"]
            print(f"{arm:<8} budget {budget:>3}: right verdicts {right}; people's error {error:.3f}")
    record = {
        "person": args.person,
        "budgets": args.budgets,
        "draws": args.draws,
        "arms": {
            a: {"feedback.random_share": v, "priority": r or ("product" if v < 1 else None)}
            for a, (v, r) in ARMS.items()
        },
        "gates": GATES,
        "against_random": against_random(results),
        "pools": [
            {
                "pool": str(p.where.relative_to(where)),
                "served": len(p.rows),
                "share": p.share,
                "agreement": p.agreement,
            }
            for p in found
        ],
        "results": results,
        **provenance("feedback_choice.py"),
    }
    out = HERE / "results" / f"{args.label}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    picture(record, out.with_suffix(".png"))
    print(f"written to {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
