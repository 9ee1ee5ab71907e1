"""The online judge: the champion and the canary answer the same held-out prompts over HTTP, and
the canary is judged by what it answered.

The first `canary.prompts` phase-3 prompts (evaluate's held-out split) go to both OpenAI-compatible
completions routes (kubealign.serving.ask: greedy, canary.max_new_tokens); every failed request is counted by
kind; each server's own latency percentiles come from its /metrics (vLLM's request-latency histogram; NaN
where a server has none, left out). The prompts both answered are scored by evaluate's scorer (the reward model
and / or the reward functions) on prompt + answer tokens, as evaluate scores its samples (kubealign.answers.scoring;
the answer re-tokenized from its text; the EOS appended when the model ended it; an unfinished UTF-8 character at
the end of a cut answer is not in the text vLLM returns, so it is not scored), and compared with evaluate's
statistics, the champion in the baseline's place (kubealign.selection.comparison.compare), with the degeneration
figures the promotion guards read (kubealign.selection.comparison.degeneration) and the held-out reward model's
win-rate when the reward model dir holds one (held-out capability is not measured online: said
"unchecked"), and, when evaluate.llm_judge.url is set, the LLM judge's verdicts on the same pairs in both
orders, the canary's answer as the candidate (kubealign.answers.llm_judge.llm_judged: the requests and figures
of evaluate's). The decision is kubealign.serving.verdict.decide's. Output
(atomic): result.json (online metrics, both models' serving figures, the checks, the verdict), answers.json
(each prompt's answers and, with an LLM judge, its verdict), judge.md and judge.png, logged to the stage's
MLflow run. Acting on the verdict: kubealign.serving.carry_out.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from kubealign.answers.llm_judge import llm_judged
from kubealign.answers.scoring import heldout_figures, score
from kubealign.config import KubealignConfig
from kubealign.data import phases
from kubealign.data.tokenize import cut_left, encode_prompt
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.outputs import atomic_dir, check_output_path, write_json, write_result
from kubealign.promotion.guards import LLM_JUDGE_FIGURES
from kubealign.rewards.scorer import Scorer
from kubealign.rl.experience import response_masks
from kubealign.selection.comparison import compare, degeneration, function_means_by_model
from kubealign.serving import ask, pending
from kubealign.serving import verdict as rules  # the online verdict's pure rules
from kubealign.tracking.runs import stage_run
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner

STAGE = "judge"
# the LLM judge's verdicts as answers.json says them: the canary is the candidate, the champion the baseline
ONLINE_VERDICTS = {"candidate": "canary", "baseline": "champion", "tie": "tie"}


def answer_row(prompt_ids: list[int], text: str, finished: bool, tokenizer: Any) -> dict[str, Any]:
    """A scored-sample row as answers.sampling.sample makes one: prompt + answer tokens (+ EOS when the model ended
    the answer), the attention and response masks, the response tokens."""
    answer = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if finished else [])
    ids = torch.tensor([prompt_ids + answer])
    start = torch.tensor([len(prompt_ids)])
    attention, response = response_masks(ids, torch.ones(1, len(prompt_ids)), start, tokenizer.eos_token_id)
    return {"ids": ids[0], "attention": attention[0], "response": response[0], "tokens": answer}


def figures_table(
    metrics: dict[str, float], served: dict[str, dict[str, float]], lines: list[str], verdict: str
) -> str:
    """judge.md: the verdict, each check, the online comparison and both models' serving figures."""
    out = [f"# {verdict}", "", *[f"- {line}" for line in lines], "", "| online | value |", "|---|---|"]
    shown = (
        "prompts",
        "win_rate",
        "win_rate_lower_bound",
        "reward_gain",
        "baseline_reward_mean",
        "candidate_reward_mean",
        "heldout_win_rate",
        "reward_agreement",
        *LLM_JUDGE_FIGURES,
    )
    for key in shown:
        if key in metrics:
            out.append(f"| {key.replace('baseline', 'champion').replace('candidate', 'canary')} | {metrics[key]:.4g} |")
    out += ["", "| serving | champion | canary |", "|---|---|---|"]
    shown = ("requests", "errors", "error_rate", "latency_p50_s", "latency_p95_s", "latency_p99_s")
    for key in (*shown, "server_latency_p50_s", "server_latency_p95_s"):
        ours, theirs = (served[who].get(key, math.nan) for who in ("champion", "canary"))
        out.append(f"| {key} | {ours:.4g} | {theirs:.4g} |")
    return "\n".join(out) + "\n"


def scored(
    config: KubealignConfig,
    specs: list[definitions.FunctionSpec],
    tokenizer_dir: Path,
    reward: Path | None,
    data: phases.Rows,
    answers: dict[str, list[rules.Answer]],
    pairs: list[int],
) -> tuple[dict[str, list[dict[str, Any]]], int, dict[str, float]]:
    """(each model's rows of the prompts both answered, scored as evaluate scores its samples; the EOS id; the
    held-out reward model's figures, the champion in the baseline's place: answers.scoring.heldout_figures)."""
    from kubealign.models.value_head import load_reward_model

    r = config.rewards
    tokenizer = loading.load_tokenizer(str(tokenizer_dir))
    cap, bos = config.ppo.max_prompt_len, tokenizer.bos_token_id
    prompt_ids = {i: cut_left(encode_prompt(tokenizer, data.prompts[i]), cap, bos) for i in pairs}
    runner = FunctionRunner.for_config(specs, r) if specs else None
    rows: dict[str, list[dict[str, Any]]] = {}
    with runner or nullcontext():
        model = None
        if r.uses_model:
            model = load_reward_model(str(reward), False, tokenizer.pad_token_id, "fp32").eval()
        scorer = Scorer(model, r.model_weight if specs else 1.0, runner, tokenizer)
        for who, got in answers.items():
            rows[who] = [answer_row(prompt_ids[i], got[i].text or "", got[i].finished, tokenizer) for i in pairs]
            score(scorer, rows[who], config.evaluate.batch_size, data.take(pairs))
    size, scoring = config.evaluate.batch_size, reward if r.uses_model else None
    held = heldout_figures(scoring, tokenizer, rows["champion"], rows["canary"], size)
    return rows, tokenizer.eos_token_id, held


def llm_judge_verdicts(
    config: KubealignConfig, prompts: list[str], answers: dict[str, list[rules.Answer]], pairs: list[int]
) -> tuple[dict[str, float], dict[int, str | None]]:
    """When evaluate.llm_judge.url is set: the LLM judge asked about every prompt both answered, in both orders,
    the canary's answer as the candidate and the champion's as the baseline, as evaluate asks it (its figures
    llm_judge_*, which promote.guards.min_llm_judge_win_rate reads), and each pair's verdict: "canary" |
    "champion" | "tie" | None (no verdict). Without a URL, or with no pair: ({}, {}), nothing asked."""
    champion, canary = answers["champion"], answers["canary"]
    table = [
        {"prompt": prompts[i], "baseline": champion[i].text or "", "candidate": canary[i].text or ""} for i in pairs
    ]
    figures = llm_judged(config.evaluate, table)
    if not figures:
        return {}, {}
    return figures, {i: ONLINE_VERDICTS.get(row["llm_judge"]) for i, row in zip(pairs, table, strict=True)}


def answers_table(
    config: KubealignConfig,
    prompts: list[str],
    answers: dict[str, list[rules.Answer]],
    verdicts: dict[int, str | None],
    pairs: list[int],
    rows: dict[str, list[dict[str, Any]]] | None,
) -> list[dict[str, Any]]:
    """answers.json: per prompt both answers, the LLM judge's verdict (when one is set) and, for the prompts both
    answered, each reward model's scores as [champion's, canary's] ("reward": the scorer's, "heldout": the held-out
    reward model's), what feedback.served weighs the pairs people are asked about by."""
    scores: dict[int, dict[str, list[float]]] = {}
    for k, i in enumerate(pairs if rows else []):
        champion, canary = rows["champion"][k], rows["canary"][k]
        found = {"reward": [float(champion["score"]), float(canary["score"])]}
        if "heldout_score" in champion and "heldout_score" in canary:
            found["heldout"] = [float(champion["heldout_score"]), float(canary["heldout_score"])]
        scores[i] = found
    return [
        {
            "prompt": prompt,
            **{who: vars(got[i]) for who, got in answers.items()},
            **({"llm_judge": verdicts.get(i)} if config.evaluate.llm_judge.url is not None else {}),
            **({"scores": scores[i]} if i in scores else {}),
        }
        for i, prompt in enumerate(prompts)
    ]


def plot(path: Path, answers: dict[str, list[rules.Answer]], rows: dict[str, list[dict[str, Any]]] | None) -> None:
    """judge.png: each model's answered requests' latency as a cumulative share (errors marked on the right),
    and, per prompt both answered, the canary's score against the champion's (above the diagonal: the canary
    won it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for who, got in answers.items():
        latencies = sorted(a.latency_s for a in got if a.ok)
        errors = sum(not a.ok for a in got)
        shares = [(i + 1) / len(got) for i in range(len(latencies))]
        left.step(latencies, shares, where="post", label=f"{who} ({errors} of {len(got)} failed)")
    left.set(xlabel="latency (s)", ylabel="share of requests answered", title="Latency", ylim=(0, 1.02))
    left.legend(loc="lower right")
    if rows:
        ours, theirs = [r["score"] for r in rows["canary"]], [r["score"] for r in rows["champion"]]
        right.scatter(theirs, ours, alpha=0.6)
        low, high = min(ours + theirs), max(ours + theirs)
        right.plot([low, high], [low, high], color="grey", linewidth=1)
    right.set(xlabel="champion's score", ylabel="canary's score", title="Score per prompt (above: canary wins)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def decided(
    config: KubealignConfig,
    online: dict[str, float] | None,
    pairs: int,
    canary: dict[str, float],
    human: Any,
    version: str,
) -> tuple[bool, list[str], str, bool]:
    """(promoted, the checks, the verdict line, whether it waits for people: canary.await_people)."""
    promoted, lines = rules.decide(online, pairs, canary, config.promote, config.canary, human)
    awaiting = rules.awaits_people(online, pairs, canary, config.promote, config.canary, human)
    line = rules.awaiting_line(version) if awaiting else rules.verdict_line(promoted, lines, "challenger", version)
    return promoted, lines, line, awaiting


def run(
    config: KubealignConfig,
    prompts: Path,
    tokenizer_dir: Path,
    reward: Path | None,
    champion_url: str,
    canary_url: str,
    output: Path,
    served_name: str | dict[str, str] | None = None,
    canary_version: str = "?",
    served_versions: tuple[str, ...] = (),
    human: Any = None,
    champion_version: str = "?",
    agreement: dict[str, float] | None = None,
) -> dict[str, Any]:
    """served_name: the model name both servers answer to (default promote.registered_model, as `kubealign
    serve` names it), or each one's ({"champion": ..., "canary": ...}); tokenizer_dir: the policy's tokenizer
    (both versions share it); served_versions: the check lines of kubealign.serving.identity, made by the
    caller before this asks anything (the registry is the caller's to read); human: people's verdict on the
    canary's version (serving.verdict.HumanFeedback, read by the caller when canary.min_human_win_rate is set);
    champion_version: the version the champion's server serves ("?": not known), in result.json beside the canary's
    (kubealign feedback push --from-judge names both on its tasks); agreement: the judges' agreement with people
    (feedback.lookup.agreement), which promote.guards.min_judge_agreement reads in the gate."""
    cfg, r = config.canary, config.rewards
    check_output_path(output, STAGE)
    if r.uses_model and reward is None:
        raise UserError("judge: rewards use the reward model (rewards.model_weight > 0): give --reward-model DIR")
    specs = definitions.resolve(r, config.base_dir)
    split = phases.load(prompts, "phase3_prompts")
    data = phases.prompt_rows(split["eval"] if len(split["eval"]) else split["train"])
    data = data.take(list(range(min(cfg.prompts, len(data.prompts)))))
    urls = {"champion": champion_url, "canary": canary_url}
    one = served_name if isinstance(served_name, str) else config.promote.registered_model
    names = served_name if isinstance(served_name, dict) else dict.fromkeys(urls, one)
    started = time.perf_counter()
    answers = {who: ask.ask(url, names[who], data.prompts, cfg) for who, url in urls.items()}
    served = {who: rules.serving_figures(got) for who, got in answers.items()}
    for who, url in urls.items():  # the server's own view: its request-latency histogram (vLLM's /metrics)
        buckets = ask.latency_histogram(ask.scrape(url), names[who])
        for q in (50, 95) if buckets else ():
            served[who][f"server_latency_p{q}_s"] = rules.histogram_quantile(buckets, q / 100)
    pairs = rules.answered_pairs(answers["champion"], answers["canary"])
    metrics: dict[str, float] = {}
    rows = None
    if pairs:
        rows, eos, held = scored(config, specs, tokenizer_dir, reward, data, answers, pairs)
        metrics = compare(rows["champion"], rows["canary"], config.evaluate.seed)
        metrics.update(held)  # the held-out reward model's win-rate (promote.guards.min_heldout_win_rate) online
        metrics.update(function_means_by_model(rows["champion"], rows["canary"]))
        # the guards' answer figures (promote.guards), the champion in the baseline's place as for the rest
        metrics.update(degeneration(rows["champion"], eos, "baseline"))
        metrics.update(degeneration(rows["canary"], eos, "candidate"))
        metrics.update(agreement or {})  # the judges checked against people: the gate's min_judge_agreement
    judged, verdicts = llm_judge_verdicts(config, data.prompts, answers, pairs)
    metrics.update(judged)  # the LLM judge's figures (promote.guards.min_llm_judge_win_rate), when one is set
    judged_on = (metrics or None, len(pairs), served["canary"])
    promoted, lines, verdict, awaiting = decided(config, *judged_on, human, canary_version)
    lines = [*served_versions, *lines]
    for who, figures in served.items():
        metrics.update({f"{who}/{key}": value for key, value in figures.items()})
    metrics["promoted"], metrics["wall_time_s"] = float(promoted), time.perf_counter() - started
    metrics["awaiting_people"] = float(awaiting)
    table = answers_table(config, data.prompts, answers, verdicts, pairs, rows)
    outputs = {"answers": "answers.json", "report": "judge.md", "plot": "judge.png"}
    versions = {"champion": champion_version, "canary": canary_version}  # what feedback.served names on its tasks
    with stage_run(STAGE, config, output.resolve().parent, required=False) as tracker:
        with atomic_dir(output) as tmp:
            write_json(tmp / "answers.json", table)
            (tmp / "judge.md").write_text(figures_table(metrics, served, lines, verdict), encoding="utf-8")
            plot(tmp / "judge.png", answers, rows)
            more = {"versions": versions, "judge_run": tracker.run_id, "registered_model": one, "checks": lines}
            more["awaiting_people"] = awaiting
            result = write_result(tmp, STAGE, metrics, outputs, promoted=promoted, verdict=verdict, **more)
        tracker.log_metrics(metrics)
        if awaiting:  # what the next run's settle task finds (kubealign.serving.pending)
            tracker.set_tags(pending.tags(config.promote.registered_model, canary_version, champion_version))
        for name in outputs.values():
            tracker.log_artifact(output / name, STAGE)
    print(verdict, flush=True)
    return {**result, "output": str(output)}
