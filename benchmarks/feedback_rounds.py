"""Continuous alignment rehearsed on a laptop (issue 79): rounds of serve -> people -> retrain on the tiny preset,
with a scripted person, over seeds, and two ways of choosing the pairs people see, side by side.

One rehearsal (a seed, an arm) has its own MLflow store and Label Studio stand-in (tests/feedback/standin.py):

* round 0: `kubealign run` (kfp.local) with feedback.project set; its version becomes the champion;
* round r = 1..R: `kubealign round next` (it pulls people's choices so far: data-split puts them in phase 2's train
  split, the DPO route and the reward model learn from them); the new version is the challenger. Both versions are
  served here (tests/support/completions.py: transformers behind the routes `kubealign serve` answers); `kubealign
  judge --champion --canary` asks both the held-out prompts (nothing moved); `kubealign round push --judge` sends the
  served pairs to people (feedback.budget, the arm's feedback.random_share); the scripted person annotates them
  (tests/feedback/standin.annotate: 10 % noise, 10 % skips, a pair it finds equally good skipped); `kubealign
  feedback pull` measures each judge against people and people's verdict on the canary's version; then `kubealign
  judge --act` judges the canary again with people's check (canary.min_human_win_rate), the judges people disagree
  with untrusted (promote.guards.min_judge_agreement), and promotes it or rolls it back.
* every round's training seeds differ (seed * 100 + r; data.seed is the rehearsal's seed): two rounds trained on the
  same rows with the same seeds are bit-equal.

The person's hidden preference (`--person`, PEOPLE), by the synthetic grammar (kubealign.data.synthetic.grade):
* opener (the default): a well-formed answer first, then one opening with FAVOURITE, then an answer to the question
  asked, then any courteous opener. The synthetic pairs rate the five courteous openers alike: which one this person
  likes is taught by people's rows alone.
* topic (the first runs' person): an answer to the question asked first, then a well-formed one, then a courteous
  opener. The synthetic pairs contrast openers only (both sides on topic); the tiny reward model did not learn the
  topic from clean pairs either (docs/feedback.md "The rehearsal").

Recorded per round: the verdict and its checks, the judge's online figures, each judge's agreement with people
when it judged, and the truth the person would give over every served pair (noise free): the canary's share of
pairs the person prefers (ties half); the verdict is right when it promoted a canary whose share is above 0.5 or kept
the champion otherwise. At the end: people's win-rate (with the person's noise, Wilson 95 %) of the final champion
against round 0's on the held-out prompts, and a picture across rounds.

  python benchmarks/feedback_rounds.py   # seeds 0 1 2, 3 rounds, both arms -> results/feedback-rounds-tiny-cpu.*
  python benchmarks/feedback_rounds.py --seeds 0 --rounds 1 --arms disagree --label try
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from train_throughput import machine  # noqa: E402

TOKEN = "rehearsal-token"
ARMS = {"disagree": 0.25, "random": 1.0}  # feedback.random_share: a quarter at random, or all of them
SEEDED = ("sft.seed", "reward.seed", "ppo.seed", "evaluate.seed")  # data.seed stays: one split, one held-out set
# the tiny preset cut to about 1.5 minutes a round on 2 cores (81 % of SFT's answers well formed), its held-out
# split large enough to serve 48 prompts
SETTINGS = [
    "data.synthetic_pairs=600",
    "data.synthetic_sft_rows=600",
    # phase 3's eval split is what the judge serves; the prompts people answered leave it each round (phase: reward)
    "data.eval_fraction=0.25",
    "sft.num_train_epochs=10",
    "reward.num_train_epochs=2",
    # the DPO route: it learns from people's pairs of served answers directly (with the SFT loss on the chosen one,
    # the preset's rpo_alpha); through the reward model and PPO the person's choices moved nothing at this size
    # (docs/feedback.md "The rehearsal")
    "pipeline.candidates=[{route: dpo}]",
    "ppo.num_iterations=8",
    "evaluate.max_prompts=16",
    # people's rows three times over in phase 2's train split, beside the synthetic pairs
    "feedback.weight=3",
    # the offline gate (candidate against its own SFT model) only registers a challenger each round; what is
    # promoted is the online judge's call (JUDGE_SETTINGS)
    "promote.min_win_rate=0",
    "promote.min_reward_gain=-100",
    "promote.min_win_rate_lower_bound=null",
    "promote.mode=canary",
    # offline, each round's candidate is scored by its own round's reward model: the champion's offline reward is
    # another model's figure; the online judge compares the two versions on the same prompts and scorer
    "promote.require_beat_champion=false",
    "canary.prompts=48",
    "canary.max_new_tokens=24",
    "canary.min_answers=32",
]
# online: the canary must win at least half the prompts, a tie counting half (greedy answers of two close versions
# are often the same), for the training reward model and the held-out one alike, and not lose mean reward; a judge
# agreeing with people on less than 0.6 of their choices is not trusted; and people, asked about the canary's served
# pairs before the verdict, must prefer it on at least half of those they decided (weighted as pushed). Online only:
# offline, an untrusted judge would keep every later challenger from being served
JUDGE_SETTINGS = [
    "promote.min_win_rate=0.5",
    "promote.tie_credit=0.5",
    "promote.min_reward_gain=0",
    "promote.guards.min_judge_agreement=0.6",
    "canary.min_human_win_rate=0.5",
]


FAVOURITE = "Thanks for asking!"


def prefer_topic(prompt: str, text: str) -> float:
    """Person "topic": an answer to the question asked first, then a well-formed one, then a courteous opener."""
    from kubealign.data import synthetic

    g = synthetic.grade(prompt, text)
    return 4 * g.on_topic + 2 * g.well_formed + (g.style == "courteous")


def prefer_opener(prompt: str, text: str) -> float:
    """Person "opener": a well-formed answer first, then one opening with FAVOURITE (the synthetic pairs rate the
    five courteous openers alike), then an answer to the question asked, then any courteous opener."""
    from kubealign.data import synthetic

    g = synthetic.grade(prompt, text)
    favourite = g.well_formed and text.strip().startswith(FAVOURITE + " ")
    return 8 * g.well_formed + 4 * favourite + 2 * g.on_topic + (g.style == "courteous")


PEOPLE = {"topic": prefer_topic, "opener": prefer_opener}


def cli(*args: Any) -> None:
    from kubealign.cli import main

    code = main([str(a) for a in args])
    if code != 0:
        raise SystemExit(f"kubealign {' '.join(map(str, args))}: exit {code}")


def stage_dir(run: Path, stage: str) -> Path:
    return Path(json.loads((run / "run.json").read_text())["stages"][stage]["dir"])


def truth(answers: list[dict[str, Any]], prefer: Any) -> dict[str, float]:
    """The person's noise-free verdict over every served pair: the canary's share (ties half) and the ties."""
    wins = ties = 0
    for row in answers:
        champion, canary = (prefer(row["prompt"], row[w]["text"] or "") for w in ("champion", "canary"))
        wins += canary > champion
        ties += canary == champion
    return {"canary_share": (wins + ties / 2) / len(answers), "ties": ties / len(answers), "pairs": len(answers)}


def served_pair(uri: str, config: Any, work: Path) -> tuple[tuple[Any, Any], tuple[str, str]]:
    """The registry's champion and challenger, each served here (their registered files, checked); their versions."""
    from kubealign.feedback import push
    from tests.support.completions import Served

    name = config.promote.registered_model
    sides = push.registered_dirs(config.serve, uri, name, ["champion", "challenger"])
    return tuple(Served(d, name, side.version) for side, d in sides), tuple(side.version for side, _ in sides)


def judge_round(run: Path, uri: str, config_file: Path, config: Any, people: Any) -> tuple[Path, Path]:
    """The round's canary served beside the champion: judged online (nothing moved), its served pairs pushed to people
    and annotated (`people`: a callable doing that), people's choices pulled (each judge's agreement, people's verdict
    on the canary's version), then judged again with people's check and the verdict carried out in the registry.
    (the judge's output of what was served, the acting judge's output)."""
    (champion, canary), versions = served_pair(uri, config, run)
    with champion, canary:
        sets = [a for s in JUDGE_SETTINGS for a in ("--set", s)]
        split, sft, reward = (stage_dir(run, s) for s in ("data-split", "sft", "reward"))
        asked = ["--config", config_file, "--champion", champion.url, "--canary", canary.url, "--prompts", split,
                 "--tokenizer", sft, "--reward", reward, *sets]  # fmt: skip
        served = run / "served"
        cli("judge", *asked, "--output", served)
        # without --act the judge reads no registry and names no version: the versions served here, for the push
        said = json.loads((served / "result.json").read_text())
        said["versions"] = dict(zip(("champion", "canary"), versions, strict=True))
        (served / "result.json").write_text(json.dumps(said))
        people(served)
        cli("feedback", "pull", "--project", "prefs", "--output", run / "people.jsonl", "--config", config_file)
        cli("judge", *asked, "--output", run / "judge", "--act")
    return served, run / "judge"


def registered_dir(uri: str, name: str, version: str) -> Path:
    """A registered version's HF directory, downloaded and checked against its manifest (as serve gets it)."""
    from mlflow.tracking import MlflowClient

    from kubealign.serving import local, location

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    found = location.served_version(client.get_model_version(name, version), name, f"v{version}", uri)
    return local.verified_copies([found], uri)[0]


def people_win_rate(
    uri: str, config: Any, first: str, final: str, split: Path, seed: int, prefer: Any
) -> dict[str, Any]:
    """The person (with 10 % noise) choosing between round 0's champion and the final one, both served, on the
    held-out prompts the judge asks; pairs the person finds equally good are not decided."""
    from kubealign.feedback.annotations import wilson
    from kubealign.feedback.push import held_out_prompts
    from tests.support.completions import Served

    if first == final:
        return {"win_rate": 0.5, "low": None, "high": None, "decided": 0, "same_version": True}
    name, n = config.promote.registered_model, config.canary.prompts
    prompts = held_out_prompts(split, n)
    said = {}
    for version in (first, final):
        served = Served(registered_dir(uri, name, version), name, version)
        said[version] = [served.complete(p, config.canary.max_new_tokens)["text"] for p in prompts]
    rng, wins, decided = random.Random(f"people-{seed}"), 0, 0
    for prompt, old, new in zip(prompts, said[first], said[final], strict=True):
        a, b = prefer(prompt, new), prefer(prompt, old)
        if a == b:
            continue
        wins += (a > b) != (rng.random() < 0.1)
        decided += 1
    low, high = wilson(wins, decided) if decided else (None, None)
    return {"win_rate": wins / decided if decided else 0.5, "low": low, "high": high, "decided": decided,
            "prompts": len(prompts)}  # fmt: skip


def one_round(run: Path, uri: str, ls: Any, seed: int, r: int, prefer: Any, keep: Path | None = None) -> dict[str, Any]:
    """After `round next` made `run`: its canary judged and acted on, its served pairs pushed and annotated; what
    the round did. A round whose offline gate registered no challenger has nothing served: said, and skipped.
    keep: a folder the judge's output of what was served is copied into (round-<r>/): benchmarks/feedback_choice.py."""
    from kubealign.config import config_from_json
    from tests.feedback.standin import annotate

    index = json.loads((run / "run.json").read_text())
    config = config_from_json(index["config_json"])
    config_file = run / "round-config.json"
    config_file.write_text(index["config_json"])
    pulled = json.loads((stage_dir(run, "feedback") / "result.json").read_text())["metrics"]
    row: dict[str, Any] = {
        "round": r,
        "agreement_at_start": {k: v for k, v in pulled.items() if k.startswith("agreement_")},
        "people_rows_trained_on": pulled.get("rows", 0),
    }
    promoted = json.loads((stage_dir(run, "promote") / "result.json").read_text())
    if promoted["aliases"].get("challenger") != promoted["version"]:
        return {**row, "canary": None, "gate": promoted["gate"]}
    done: dict[str, int] = {}

    def people(served: Path) -> None:
        cli("round", "push", "--from", run, "--judge", served, "--url", ls.url)
        tasks = ls.store.projects[1]["tasks"]
        done.update(annotate(tasks, prefer, noise=0.1, skip=0.1, seed=seed * 100 + r, skip_level=True))

    os.environ["LABEL_STUDIO_URL"] = ls.url  # where `feedback pull` finds it
    served, judged = judge_round(run, uri, config_file, config, people)
    if keep is not None:
        shutil.copytree(served, keep / f"round-{r}")
    result = json.loads((judged / "result.json").read_text())  # kubealign judge's
    answers = json.loads((served / "answers.json").read_text())
    row["agreement_when_judged"] = {k: v for k, v in result["metrics"].items() if k.startswith("agreement_")}
    row.update(
        canary=result["versions"]["canary"],
        versions=result["versions"],
        promoted=result["promoted"],
        online={k: v for k, v in result["metrics"].items() if "/" not in k},
        checks=result["checks"],
        truth=truth(answers, prefer),
        annotated=done,
    )
    row["right"] = row["promoted"] == (row["truth"]["canary_share"] > 0.5)
    return row


def rehearse(
    work: Path, seed: int, arm: str, rounds: int, budget: int, person: str, extra: list[str], keep: Path | None = None
) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    from kubealign.config import config_from_json
    from kubealign.feedback.client import LabelStudio
    from kubealign.feedback.lookup import agreement
    from kubealign.feedback.pairs import LABEL_CONFIG
    from kubealign.promotion.aliases import read_state
    from tests.feedback.standin import LabelStudioStandIn

    uri = f"sqlite:///{work}/mlflow.db"
    os.environ.update(MLFLOW_TRACKING_URI=uri, LABEL_STUDIO_API_KEY=TOKEN, TQDM_DISABLE="1")
    record: dict[str, Any] = {"seed": seed, "arm": arm, "rounds": []}
    with LabelStudioStandIn(TOKEN) as ls:
        LabelStudio(ls.url, TOKEN).create_project("prefs", LABEL_CONFIG)
        fixed = [*SETTINGS, *extra, "feedback.project=prefs", f"feedback.url={ls.url}", f"feedback.budget={budget}",
                 f"feedback.random_share={ARMS[arm]}"]  # fmt: skip
        seeded = lambda r: [f"{k}={seed * 100 + r}" for k in SEEDED]  # noqa: E731
        started = time.perf_counter()
        first = [*fixed, f"data.seed={seed}", *seeded(0)]
        cli("run", *(a for s in first for a in ("--set", s)), "--output", work / "round-0")
        record["round0_champion"] = str(
            json.loads((stage_dir(work / "round-0", "promote") / "result.json").read_text())["version"]
        )
        for r in range(1, rounds + 1):
            run = work / f"round-{r}"
            sets = [a for s in seeded(r) for a in ("--set", s)]
            cli("round", "next", "--from", work / f"round-{r - 1}", "--output", run, *sets)
            row = one_round(run, uri, ls, seed, r, PEOPLE[person], keep and keep / f"seed-{seed}-{arm}")
            record["rounds"].append(row)
            took = time.perf_counter() - started
            if row["canary"] is None:
                print(f"  seed {seed} {arm} round {r}: no challenger (the offline gate refused); {took:.0f} s")
                continue
            said = "promoted" if row["promoted"] else "rolled back"
            share, right = row["truth"]["canary_share"], "right" if row["right"] else "WRONG"
            print(f"  seed {seed} {arm} round {r}: canary {said} (person's share {share:.2f}, {right}); {took:.0f} s")
        record["per_round"] = per_round(ls.store.projects[1]["tasks"])
        config_file = work / f"round-{rounds}" / "round-config.json"
        config = config_from_json(config_file.read_text())
        if any(row["canary"] for row in record["rounds"]):
            pull = ["--output", work / "final.jsonl", "--url", ls.url, "--config", config_file]
            cli("feedback", "pull", "--project", "prefs", *pull)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment).experiment_id
    record["agreement_final"] = agreement(client, experiment, config.promote.registered_model)
    champion = str(read_state(client, config.promote.registered_model)[0]["champion"])
    record["final_champion"] = champion
    split = stage_dir(work / f"round-{rounds}", "data-split")
    round0 = record["round0_champion"]
    record["final_vs_round0"] = people_win_rate(uri, config, round0, champion, split, seed, PEOPLE[person])
    record["wall_s"] = time.perf_counter() - started
    return record


def per_round(tasks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Of each round's pushed tasks people decided: each judge's agreement with them (Wilson 95 %) and the
    challenger's weighted win-rate (feedback.agreement, as a pull computes them over all rounds)."""
    from kubealign.feedback import agreement

    decided = agreement.decisions(tasks)
    out = {}
    for number in sorted({m["round"] for m, _ in decided}):
        these = [(m, c) for m, c in decided if m["round"] == number]
        found = agreement.agreements(these)
        judges = {j: {"rate": a.rate, "low": a.low, "high": a.high, "leaned": a.leaned} for j, a in found.items()}
        rate = agreement.weighted_win_rate(these, "challenger")
        out[number] = {"decided": len(these), "people_win_rate_weighted": rate, "agreement": judges}
    return out


def summary(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Per arm, over seeds: the final champion's pooled win-rate against round 0's (people, Wilson 95 %), the
    verdicts the person would call right, and the mean of each round's figures."""
    from kubealign.feedback.annotations import wilson

    out = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        finals = [r["final_vs_round0"] for r in mine]
        wins = sum(round(f["win_rate"] * f["decided"]) for f in finals)
        decided = sum(f["decided"] for f in finals)
        low, high = wilson(wins, decided) if decided else (None, None)
        verdicts = [row for r in mine for row in r["rounds"] if row["canary"] is not None]
        out[arm] = {
            "final_vs_round0_pooled": {
                "win_rate": wins / decided if decided else None,
                "low": low,
                "high": high,
                "decided": decided,
            },
            "final_vs_round0_per_seed": [f["win_rate"] for f in finals],
            "verdicts_right": f"{sum(v['right'] for v in verdicts)} of {len(verdicts)}",
            "promoted": f"{sum(v['promoted'] for v in verdicts)} of {len(verdicts)}",
            "rounds_without_a_challenger": sum(row["canary"] is None for r in mine for row in r["rounds"]),
        }
    return out


def series(runs: list[dict[str, Any]], get: Any) -> tuple[list[int], list[float]]:
    """(rounds, the mean over runs of get(that round's per_round figures)), rounds where some run has one."""
    xs, ys = [], []
    tables = [{int(k): v for k, v in r["per_round"].items()} for r in runs]  # JSON keeps the rounds as text
    for n in sorted({n for table in tables for n in table}):
        got = [get(table[n]) for table in tables if n in table]
        got = [v for v in got if v is not None and v == v]  # NaN: a judge that leaned on no decided task
        if got:
            xs.append(n)
            ys.append(sum(got) / len(got))
    return xs, ys


def picture(runs: list[dict[str, Any]], arms: list[str], path: Path) -> None:
    """Across rounds, per arm (mean over seeds): people's weighted win-rate of the round's canary, and each judge's
    agreement with people on that round's pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for arm, style in zip(arms, ("-o", "--s"), strict=False):
        mine = [r for r in runs if r["arm"] == arm]
        xs, ys = series(mine, lambda d: d["people_win_rate_weighted"])
        left.plot(xs, ys, style, label=arm)
        for judge in ("reward", "heldout"):
            xs, ys = series(mine, lambda d, j=judge: (d["agreement"].get(j) or {}).get("rate"))
            right.plot(xs, ys, style, label=f"{judge} ({arm})")
    left.axhline(0.5, color="grey", lw=0.8)
    left.set(title="people's win-rate of each round's canary", xlabel="round", ylabel="weighted win-rate", ylim=(0, 1))
    right.set(title="each judge's agreement with people", xlabel="round", ylabel="agreement", ylim=(0, 1))
    for axis in (left, right):
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    left.legend(title="pairs chosen")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["disagree", "random"])
    parser.add_argument("--budget", type=int, default=24, help="feedback.budget: tasks pushed a round")
    parser.add_argument("--person", choices=sorted(PEOPLE), default="opener", help="the hidden preference")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another setting")
    parser.add_argument("--label", default="feedback-rounds-tiny-cpu")
    parser.add_argument("--resume", action="store_true", help="keep the rehearsals the label's JSON already holds")
    parser.add_argument("--picture", type=Path, metavar="JSON", help="only draw the picture of a recorded run")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="copy each round's served pairs (the judge's output) here"
    )
    args = parser.parse_args()
    if args.picture:
        done = json.loads(args.picture.read_text())
        picture(done["runs"], list(done["arms"]), args.picture.with_suffix(".png"))
        return
    out = HERE / "results" / f"{args.label}.json"
    # --resume: the rehearsals a run cut short recorded are kept, and not run again
    runs: list[dict[str, Any]] = json.loads(out.read_text())["runs"] if args.resume and out.exists() else []
    for seed in args.seeds:
        for arm in args.arms:
            if any((r["seed"], r["arm"]) == (seed, arm) for r in runs):
                continue
            with tempfile.TemporaryDirectory(prefix="rounds-") as tmp:
                runs.append(rehearse(Path(tmp), seed, arm, args.rounds, args.budget, args.person, args.set, args.keep))
            f = runs[-1]["final_vs_round0"]
            said = f"people's win-rate {f['win_rate']:.2f} of {f['decided']} decided"
            print(f"seed {seed} {arm}: final champion v{runs[-1]['final_champion']} against round 0's: {said}")
            record(args, runs, out)  # after each rehearsal: a run cut short keeps what it measured
    picture(runs, args.arms, out.with_suffix(".png"))
    print(json.dumps(summary(runs, args.arms), indent=2))
    print(f"written to {out} and {out.with_suffix('.png')}")


def record(args: argparse.Namespace, runs: list[dict[str, Any]], out: Path) -> None:
    done = {
        "preset": "tiny-cpu",
        "settings": [*SETTINGS, *args.set],
        "person": args.person,
        "judge_settings": JUDGE_SETTINGS,
        "budget": args.budget,
        "arms": {a: {"feedback.random_share": ARMS[a]} for a in args.arms},
        "summary": summary(runs, args.arms),
        "runs": runs,
        **provenance("feedback_rounds.py"),
    }
    out.write_text(json.dumps(done, indent=2) + "\n")


def provenance(script: str) -> dict[str, Any]:
    """Where a recorded result came from: the machine, the command line, the commit."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    return {"machine": machine(), "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]), "commit": commit}


if __name__ == "__main__":
    main()
