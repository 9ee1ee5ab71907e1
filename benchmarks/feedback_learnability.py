"""What a tiny round can learn from people's pairs (issue 79): the diagnosis behind the rounds rehearsal's choices
(benchmarks/feedback_rounds.py, docs/feedback.md "The rehearsal").

Clean pairs of the kind a scripted person would decide are added to the tiny preset's data as people's rows are
(`phase: reward`, weight 3), and one `kubealign run` (kfp.local) trains on them; then:

* the reward model's accuracy on 300 fresh pairs of that kind (prompts none of the rows asked);
* the route's policy, greedy on 48 held-out prompts: the share of answers on topic, well formed, and opening with
  FAVOURITE (the rehearsal's "opener" person).

Kinds: `topic` (the same opener, an on-topic fact chosen over another topic's: what the "topic" person wants), and
`opener` (the same fact, FAVOURITE chosen over another courteous opener, which the synthetic pairs rate alike).

  python benchmarks/feedback_learnability.py   # -> results/feedback-learnability-tiny-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from feedback_rounds import FAVOURITE, SETTINGS, cli, provenance, stage_dir  # noqa: E402

# (label, kind of people's rows, how many, route): the preset alone, then each kind through each route
RUNS = [
    ("none-ppo", None, 0, "ppo"),
    ("topic-100-ppo", "topic", 100, "ppo"),
    ("topic-100-dpo", "topic", 100, "dpo"),
    ("opener-20-ppo", "opener", 20, "ppo"),
    ("opener-20-ppo-30-iterations", "opener", 20, "ppo"),
    ("opener-20-dpo", "opener", 20, "dpo"),
]
WEIGHT = 3


def pair(rng: random.Random, kind: str, topic: str, question: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of `kind`, the sides alike but for what the kind is about."""
    from kubealign.data import synthetic as s

    fact = rng.choice(s.FACTS[topic])
    if kind == "topic":
        opener = rng.choice(["", rng.choice(s.COURTEOUS), rng.choice(s.DISMISSIVE)])
        other = rng.choice(s.FACTS[rng.choice([t for t in s.FACTS if t != topic])])
        lead = f" {opener}" if opener else ""
        return s.format_prompt(question), f"{lead} {fact}", f"{lead} {other}"
    other = rng.choice([c for c in s.COURTEOUS if c != FAVOURITE])
    return s.format_prompt(question), f" {FAVOURITE} {fact}", f" {other} {fact}"


def pairs(kind: str, n: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str, str]]:
    from kubealign.data import synthetic as s

    rng = random.Random(f"{kind}-{seed}")
    space = [(t, q) for t, q in s._prompt_space() if s.format_prompt(q) not in exclude]
    return [pair(rng, kind, t, q) for t, q in rng.sample(space, n)]


def accuracy(reward_dir: Path, tests: list[tuple[str, str, str]]) -> float:
    """The share of pairs whose chosen side the reward model scores higher."""
    import torch

    from kubealign.models.loading import load_tokenizer
    from kubealign.models.value_head import last_token_scores, load_reward_model, token_values

    tokenizer = load_tokenizer(str(reward_dir))
    tokenizer.padding_side = "right"
    model = load_reward_model(str(reward_dir), False, tokenizer.pad_token_id, "fp32").eval()

    def scores(texts: list[str]) -> Any:
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            return last_token_scores(token_values(model, enc.input_ids, enc.attention_mask), enc.attention_mask)

    chosen, rejected = scores([p + c for p, c, _ in tests]), scores([p + r for p, _, r in tests])
    return float((chosen > rejected).float().mean())


def policy(model_dir: Path, split: Path) -> dict[str, float]:
    """Greedy answers of the policy to 48 held-out prompts, graded by the synthetic grammar."""
    from kubealign.data import synthetic
    from kubealign.feedback.push import held_out_prompts
    from tests.support.completions import Served

    prompts = held_out_prompts(split, 48)
    graded = {"on_topic": 0, "well_formed": 0, "favourite": 0}
    with Served(model_dir, "policy", "1") as served:
        for prompt in prompts:
            text = served.complete(prompt, 24)["text"] or ""
            g = synthetic.grade(prompt, text)
            graded["on_topic"] += g.on_topic
            graded["well_formed"] += g.well_formed
            graded["favourite"] += g.well_formed and text.strip().startswith(FAVOURITE + " ")
    return {k: v / len(prompts) for k, v in graded.items()}


def one(work: Path, label: str, kind: str | None, n: int, route: str, seed: int) -> dict[str, Any]:
    rows = pairs(kind, n, seed) if kind else []
    sources = "[{path: synthetic}]"
    if rows:
        people = work / f"{label}.jsonl"
        people.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
        sources = f"[{{path: synthetic}}, {{path: {people}, phase: reward, weight: {WEIGHT}}}]"
    sets = [s for s in SETTINGS if not s.startswith("pipeline.candidates")]
    sets += [f"data.sources={sources}", f"pipeline.candidates=[{{route: {route}}}]", f"data.seed={seed}"]
    if label.endswith("30-iterations"):
        sets.append("ppo.num_iterations=30")
    run = work / label
    cli("run", *(a for s in sets for a in ("--set", s)), "--output", run)
    asked = {p for p, _, _ in rows}
    found: dict[str, Any] = {"label": label, "kind": kind, "rows": n, "weight": WEIGHT, "route": route}
    for test in ("topic", "opener"):
        found[f"reward_accuracy_{test}"] = accuracy(stage_dir(run, "reward"), pairs(test, 300, seed + 99, asked))
    if rows:
        found["reward_accuracy_own_rows"] = accuracy(stage_dir(run, "reward"), rows)
    found["policy"] = policy(stage_dir(run, route if route == "dpo" else "ppo"), stage_dir(run, "data-split"))
    found["sft"] = policy(stage_dir(run, "sft"), stage_dir(run, "data-split"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", choices=[r[0] for r in RUNS], help="only these (default: all)")
    parser.add_argument("--label", default="feedback-learnability-tiny-cpu")
    args = parser.parse_args()
    out = HERE / "results" / f"{args.label}.json"
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="learnability-") as tmp:
        os.environ.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/mlflow.db", TQDM_DISABLE="1")
        for label, kind, n, route in RUNS:
            if args.runs and label not in args.runs:
                continue
            started = time.perf_counter()
            found.append({**one(Path(tmp), label, kind, n, route, args.seed), "wall_s": time.perf_counter() - started})
            f = found[-1]
            accuracies = f"topic {f['reward_accuracy_topic']:.2f}, opener {f['reward_accuracy_opener']:.2f}"
            print(f"{label}: reward model {accuracies}; policy {json.dumps(f['policy'])}", flush=True)
            record(args, found, out)  # after each run: a run cut short keeps what it measured


def record(args: argparse.Namespace, found: list[dict[str, Any]], out: Path) -> None:
    done = {
        "runs": found,
        "settings": SETTINGS,
        **provenance("feedback_learnability.py"),
    }
    out.write_text(json.dumps(done, indent=2) + "\n")


if __name__ == "__main__":
    main()
