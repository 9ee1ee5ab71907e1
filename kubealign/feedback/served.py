"""Pairs from what was served: the online judge's answers (its output's answers.json: the champion's and the
canary's answers to the same prompts, each judge's scores and the LLM judge's verdict) as pairwise Label Studio
tasks, nothing regenerated; a pair of identical answers is never pushed (a tie, known without asking). Up to
`feedback.budget` pairs a round, chosen by feedback.choice (where the judges disagree most, a lone judge where it is
least sure, the rest at random: `feedback.random_share`); each task's meta names the versions (champion:V,
challenger:V: the canary is the registry's challenger), the prompt's sha256, the judge's MLflow run and output, the
round, the stratum and weight of its choice and each judge's probability that answer1 is better.

The judge's files are read as input: answers.json a list of {prompt, champion, canary} objects, result.json the
judge stage's with both versions (stages/judge.py writes them); anything else is one line naming the file and field.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from kubealign.errors import UserError
from kubealign.feedback import choice, pairs

JUDGED = ("reward", "heldout")  # the reward models whose scores answers.json holds per prompt


class Served(NamedTuple):
    tasks: list[dict[str, Any]]
    served: int  # pairs both models answered with different answers: the pairs people can be asked about
    chosen: list[choice.Chosen]
    versions: tuple[str, str]  # champion's, canary's
    judge_run: str | None
    identical: int = 0  # pairs both answered alike: a tie known without asking, never pushed


def read_judged(judge_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(answers.json's rows, result.json) of a judge output, checked (module docstring)."""
    loaded = []
    for name in ("answers.json", "result.json"):
        path = Path(judge_dir) / name
        try:
            loaded.append(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise UserError(f"--from-judge {judge_dir}: no {name}; is this a judge output (kubealign judge)?") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    rows, result = loaded
    where = Path(judge_dir) / "result.json"
    if not isinstance(result, dict) or result.get("stage") != "judge":
        stage = result.get("stage") if isinstance(result, dict) else None
        raise UserError(f"{where}: not the judge stage's result (stage {stage!r})")
    versions = result.get("versions")
    for who in ("champion", "canary"):
        got = versions.get(who) if isinstance(versions, dict) else None
        if not (isinstance(got, str) and got.isdigit()):
            raise UserError(f"{where}: versions.{who} is {got!r}, not a registry version (judge with the registry)")
    where = Path(judge_dir) / "answers.json"
    if not isinstance(rows, list):
        raise UserError(f"{where}: not a list of prompts")
    for number, row in enumerate(rows):
        problem = row_problem(row)
        if problem:
            raise UserError(f"{where}: [{number}]: {problem}")
    return rows, result


def row_problem(row: Any) -> str | None:
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        return "not an object with a prompt text"
    for who in ("champion", "canary"):
        answer = row.get(who)
        if not isinstance(answer, dict) or not isinstance(answer.get("text"), str | None):
            return f"{who} is not an answer object (its text a string or null)"
    scores = row.get("scores", {})
    if not isinstance(scores, dict):
        return "scores is not an object"
    for name, pair in scores.items():
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int | float) for v in pair)):
            return f"scores.{name} is not [champion's, canary's] numbers"
    return None


def probabilities(row: dict[str, Any]) -> dict[str, float]:
    """Each judge's P(the canary's answer is better) of one served pair (feedback.choice)."""
    scores = {name: tuple(row["scores"][name]) for name in JUDGED if name in row.get("scores", {})}
    return choice.canary_probabilities(scores, row.get("llm_judge"))


def served_tasks(
    judge_dir: Path, registered_model: str, budget: int, random_share: float, seed: int, round_number: int
) -> Served:
    """The tasks of one round's push (module docstring), in the order feedback.choice chose them."""
    rows, result = read_judged(judge_dir)
    both = [r for r in rows if r["champion"]["text"] is not None and r["canary"]["text"] is not None]
    # the same answer twice is no choice: every judge scores it level (a lone judge's priority 1, "least sure"), and
    # asking would spend people's time on pairs whose outcome, a tie, is known
    answered = [r for r in both if r["champion"]["text"] != r["canary"]["text"]]
    judged = [probabilities(r) for r in answered]
    chosen = choice.choose([choice.priority(p) for p in judged], budget, random_share, seed)
    versions = (result["versions"]["champion"], result["versions"]["canary"])
    sides = (pairs.Side("champion", versions[0]), pairs.Side("challenger", versions[1]))
    run = result.get("judge_run")
    extra = []
    for c in chosen:
        prompt = answered[c.index]["prompt"]
        key = hashlib.sha256(f"{pairs.prompt_key(prompt)}|{sides[0].label}|{sides[1].label}".encode()).hexdigest()
        extra.append(
            {
                "comparison": key,
                "judge_run": run,
                "judge_output": str(Path(judge_dir).resolve()),
                "round": round_number,
                "stratum": c.stratum,
                "weight": c.weight,
                "priority": round(choice.priority(judged[c.index]), 6),
            }
        )
    picked = [answered[c.index] for c in chosen]
    tasks = pairs.pairwise_tasks(
        [r["prompt"] for r in picked],
        [r["champion"]["text"] for r in picked],
        [r["canary"]["text"] for r in picked],
        sides,
        seed,
        registered_model,
        judges=[judged[c.index] for c in chosen],
        extra=extra,
    )
    return Served(tasks, len(answered), chosen, versions, run, len(both) - len(answered))


def push_round(client: Any, project: str, judge_dir: Path, config: Any, model: str) -> tuple[Any, Served, list[str]]:
    """The judge's served pairs chosen for this round (served_tasks, with config.feedback's budget, random share and
    round) pushed into `project`: (feedback.push.Pushed, what was chosen, the lines that say so)."""
    from kubealign.feedback import push

    f = config.feedback
    got = served_tasks(judge_dir, model, f.budget, f.random_share, config.evaluate.seed, f.round)
    done = push.push_tasks(client, project, got.tasks)
    strata = [c.stratum for c in got.chosen]
    chose = (
        f"  round {f.round}: {len(got.tasks)} of {got.served} served pairs chosen (budget {f.budget}): "
        f"{strata.count('disagreement')} where the judges disagree most, {strata.count('random')} at random"
        + (f"; {got.identical} answered alike, not asked" if got.identical else "")
    )
    lines = [
        f"feedback: project {project!r} ({'created' if done.created else 'found'}, id {done.project}) at {client.url}",
        chose,
        f"  {done.added} tasks added, {done.present} were there already",
        f"  sides: champion:{got.versions[0]} and challenger:{got.versions[1]} (judge run {got.judge_run})",
    ]
    return done, got, lines
