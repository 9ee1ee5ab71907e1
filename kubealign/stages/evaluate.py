"""Stage 4, evaluate: the PPO candidate against the SFT baseline on held-out phase-3 prompts.

Both models sample from the same prompts with the same seeded settings (evaluate section); the scorer
(rewards.scorer: the reward model at each response's EOS and / or the reward functions, weighted) scores
every response, and each reward function's mean over the rows it applies to is reported as
fn/<NAME>/baseline and fn/<NAME>/candidate. Metrics: mean reward of each, win-rate of the candidate (ties
counted separately), KL(candidate || baseline) estimated on the candidate's samples, response lengths,
phase-1 eval perplexity of each (and its log, the held-out log-likelihood per token), and the figures the
promotion guards read (kubealign.promotion.guards): repeated-bigram rate, distinct-2, empty and unfinished
answers, length drift, and, when evaluate.llm_judge.url is set, an LLM judge's verdicts in both orders, and when
evaluate.suites names tasks, both models' scores on those lm-eval-harness suites (kubealign.stages.suites).
Output (atomic): result.json, samples.html / samples.md (the first `sample_rows` prompts), eval_samples.json
(every row), reward_distribution.png and, when the candidate's result.json has a PPO history,
ppo_curves.png.
"""

from __future__ import annotations

import html
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from kubealign.config import KubealignConfig
from kubealign.config.schema import EvaluateConfig
from kubealign.data import phases
from kubealign.data.split import HELDOUT
from kubealign.data.tokenize import cut_left, encode_prompt, pad_batch
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.models.value_head import load_reward_model
from kubealign.outputs import atomic_dir, check_output_path, write_json, write_result
from kubealign.rewards.scorer import Scorer
from kubealign.rl import multiturn
from kubealign.rl.experience import paired_logprobs, response_masks
from kubealign.rl.losses import Sampling
from kubealign.rl.rollout import generation_config
from kubealign.selection.comparison import compare, degeneration, function_means_by_model, heldout_comparison
from kubealign.stages import evaluate_turns, suites
from kubealign.tracking.lineage import phase_ref
from kubealign.tracking.runs import stage_run
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner

STAGE = "evaluate"


@torch.no_grad()
def sample(model: Any, tokenizer: Any, prompts: list[list[int]], cfg: EvaluateConfig) -> list[dict[str, Any]]:
    """Seeded sampling: the same seed and settings for every model, so the comparison is paired."""
    rows = []
    torch.manual_seed(cfg.seed)
    settings = generation_config(Sampling.of(cfg), cfg.max_new_tokens, tokenizer)
    for i in range(0, len(prompts), cfg.batch_size):
        ids, mask = (
            torch.tensor(x) for x in pad_batch(prompts[i : i + cfg.batch_size], tokenizer.pad_token_id, "left")
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=settings)
        start = torch.full((out.shape[0],), ids.shape[1])
        attention, response = response_masks(out, mask, start, tokenizer.eos_token_id)
        for row in range(out.shape[0]):
            tokens = out[row][attention[row].bool()][int(mask[row].sum()) :].tolist()
            rows.append({"ids": out[row], "attention": attention[row], "response": response[row], "tokens": tokens})
    return rows


def sampled(config: KubealignConfig, runner: Any, tokenizer: Any, encoded: list, data: Any, models: tuple) -> tuple:
    """(baseline's rows, candidate's rows): sampled in turns with the tools when there are tools, as the policy
    was trained (stages.evaluate_turns), else one answer each."""
    cfg = config.evaluate
    if config.tools.enabled:
        session = multiturn.ToolSession(config.tools, runner, tokenizer)
        return tuple(
            evaluate_turns.sample_turns(m, tokenizer, encoded, cfg, session, data, Sampling.of(cfg)) for m in models
        )
    return tuple(sample(m, tokenizer, encoded, cfg) for m in models)


def batched(rows: list[dict[str, Any]], size: int):
    """(rows, ids, attention, response) batches; rows of one generate call share one width already."""

    def stack(chunk: list[dict[str, Any]], key: str, width: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r[key], (0, width - r[key].shape[0])) for r in chunk])

    for i in range(0, len(rows), size):
        chunk = rows[i : i + size]
        width = max(int(r["attention"].shape[0]) for r in chunk)
        yield chunk, stack(chunk, "ids", width), stack(chunk, "attention", width), stack(chunk, "response", width - 1)


@torch.no_grad()
def score(scorer: Scorer, rows: list[dict[str, Any]], size: int, data: phases.Rows | None = None) -> None:
    """Each sample row gets "score" (the scorer's) and "fn" (each reward function's value, None where it does not
    apply); `data` holds the phase-3 rows the samples were drawn for, in the same order."""
    done = 0
    for chunk, ids, attention, response in batched(rows, size):
        part = data.take(list(range(done, done + len(chunk)))) if data is not None else None
        if "read" in chunk[0]:  # a multi-turn answer: the functions read the whole trajectory (evaluate_turns)
            width = response.shape[1]
            response = torch.stack([torch.nn.functional.pad(r["read"], (0, width - r["read"].shape[0])) for r in chunk])
        scores, values = scorer.score(ids, attention, response, part)
        for i, (row, value) in enumerate(zip(chunk, scores, strict=True)):
            row["score"] = value
            row["fn"] = {name: vs[i] for name, vs in values.items()}
        done += len(chunk)


@torch.no_grad()
def kl_to(candidate: Any, baseline: Any, rows: list[dict[str, Any]], size: int, sampling: Sampling) -> float:
    """Monte-Carlo KL(candidate || baseline) on the candidate's samples: the mean over them of the summed
    log-prob difference on response tokens, both models' log-probs at the sampling temperature without the
    top-k / top-p filter (experience.paired_logprobs, losses.scaled_logits): 0 for a model against
    itself, finite always."""
    total = 0.0
    for _chunk, ids, attention, response in batched(rows, size):
        logprobs, base_logprobs = paired_logprobs(candidate, baseline, ids, attention, response, sampling)
        total += float((logprobs - base_logprobs).sum())
    return total / max(len(rows), 1)


@torch.no_grad()
def heldout_logprob(model: Any, tokenizer: Any, rows: Any, cfg: EvaluateConfig, max_len: int) -> float:
    """The mean log-likelihood per token (nats) the model gives the held-out reference answers (`rows`' chosen,
    after their prompts; prompt tokens are not targets): the capability guard's figure, perplexity = exp(-it)."""
    from kubealign.training.lm import batch_loss, collate, tokenize

    examples = tokenize(rows, tokenizer, max_len, include_prompt=False)
    nll, count = 0.0, 0.0
    for i in range(0, len(examples), cfg.batch_size):
        out = batch_loss(model, collate(examples[i : i + cfg.batch_size], tokenizer.pad_token_id), fp32=True)
        nll, count = nll + float(out.nll_sum), count + float(out.tokens)
    return -nll / max(count, 1.0)


def heldout_dir(reward: Path | None) -> Path | None:
    """The held-out reward model the reward task trained beside REWARD (issue 53), when there is one."""
    if reward is None or not (Path(reward) / HELDOUT / "config.json").is_file():
        return None
    return Path(reward) / HELDOUT


def heldout_figures(reward: Path | None, tokenizer: Any, base: list[dict], cand: list[dict], size: int) -> dict:
    """The held-out reward model's scores of both models' answers (rows get "heldout_score") and the figures of
    comparison.heldout_comparison; with no reward model scoring, reward_model_used 0 (the guard does not apply);
    with one but no held-out model beside it, no figure (promote then names the missing guard figure)."""
    if reward is None:
        return {"reward_model_used": 0.0}
    directory = heldout_dir(reward)
    if directory is None:
        return {"reward_model_used": 1.0}
    model = load_reward_model(str(directory), False, tokenizer.pad_token_id, "fp32").eval()
    held = Scorer(model, 1.0, None, tokenizer)
    for rows in (base, cand):
        for chunk, ids, attention, response in batched(rows, size):
            for row, value in zip(chunk, held.score(ids, attention, response, None).total, strict=True):
                row["heldout_score"] = value
    return {"reward_model_used": 1.0, **heldout_comparison(base, cand)}


def judged(config: KubealignConfig, table: list[dict[str, Any]]) -> dict[str, float]:
    """On the built-in synthetic task the generator's grammar judges every response: the share that is
    well formed, on topic and preferred (courteous and on topic) for each model. Other data: nothing."""
    if not table or any(s.path != "synthetic" for s in config.data.sources):
        return {}
    from kubealign.data import synthetic

    metrics = {}
    for name in ("baseline", "candidate"):
        verdicts = [synthetic.judge(row["prompt"], row[name]) for row in table]
        for field in ("well_formed", "on_topic", "preferred"):
            metrics[f"{name}_{field}_rate"] = sum(getattr(v, field) for v in verdicts) / len(verdicts)
    return metrics


def llm_judged(cfg: EvaluateConfig, table: list[dict[str, Any]]) -> dict[str, float]:
    """When evaluate.llm_judge.url is set: the LLM judge's figures (kubealign.promotion.llm_judge), each row's
    verdict as "llm_judge" (candidate | baseline | tie, None without one). Otherwise nothing."""
    if cfg.llm_judge.url is None or not table:
        return {}
    from kubealign.serving.ask import ask_llm_judge

    judged_rows = ask_llm_judge(cfg.llm_judge, table)
    for row, verdict in zip(table, judged_rows.verdicts, strict=True):
        row["llm_judge"] = verdict
    return judged_rows.figures


def guard_figures(config: KubealignConfig, prompts: Path, tokenizer: Any, models: dict[str, tuple[Any, list]]) -> dict:
    """What the promotion guards read, for each model ({"baseline" | "candidate": (model, its sample rows)}):
    the held-out log-likelihood per token and its perplexity (when the prompts hold phase1_sft), and the
    degeneration figures of its answers."""
    figures: dict[str, float] = {}
    sft_eval = phases.load(prompts, "phase1_sft")["eval"] if (Path(prompts) / "phase1_sft").is_dir() else None
    for name, (model, rows) in models.items():
        if sft_eval is not None:
            logprob = heldout_logprob(model, tokenizer, sft_eval, config.evaluate, config.sft.max_seq_len)
            figures[f"{name}_heldout_logprob"], figures[f"{name}_perplexity"] = logprob, math.exp(-logprob)
        figures.update(degeneration(rows, tokenizer.eos_token_id, name))
    return figures


GUARD_FIGURES = (  # what the promotion guards read, as the samples page shows it beside the answers
    ("heldout_logprob", "held-out log-likelihood per token"),
    ("heldout_reward_mean", "held-out reward model's mean score"),
    ("repetition_rate", "repeated-bigram rate"),
    ("distinct_2", "distinct-2"),
    ("empty_rate", "empty answers"),
    ("unfinished_rate", "unfinished answers"),
    ("length_mean", "mean length (tokens)"),
)


def sample_table(tokenizer: Any, texts: list[str], base: list[dict], cand: list[dict]) -> list[dict[str, Any]]:
    """eval_samples.json's rows: each prompt with both models' decoded answers and their scores."""
    decode = lambda r: tokenizer.decode(r["tokens"], skip_special_tokens=True)  # noqa: E731
    return [
        {
            "prompt": p,
            "baseline": decode(b),
            "candidate": decode(c),
            "baseline_score": b["score"],
            "candidate_score": c["score"],
            **({"baseline_fn": b["fn"], "candidate_fn": c["fn"]} if b["fn"] else {}),
            **(
                {"baseline_heldout_score": b["heldout_score"], "candidate_heldout_score": c["heldout_score"]}
                if "heldout_score" in b
                else {}
            ),
        }
        for p, b, c in zip(texts, base, cand, strict=True)
    ]


def sample_tables(table: list[dict[str, Any]], metrics: dict[str, float] | None = None) -> tuple[str, str]:
    """(HTML page, Markdown) of the sample table, headed by the guards' figures of both models (`metrics`:
    evaluate's; a figure it lacks is left out); with an "llm judge" column of each row's verdict when the LLM
    judge judged ("no verdict" for a row it gave none), none without one."""
    head = ["prompt", "baseline", "candidate", "baseline score", "candidate score"]
    cells = [
        [r["prompt"], r["baseline"], r["candidate"], f"{r['baseline_score']:.3f}", f"{r['candidate_score']:.3f}"]
        for r in table
    ]
    if any("llm_judge" in r for r in table):
        head.append("llm judge")
        for row, r in zip(cells, table, strict=True):
            row.append(r.get("llm_judge") or "no verdict")
    m = metrics or {}
    figures = [
        [said, f"{m[f'baseline_{name}']:.3f}", f"{m[f'candidate_{name}']:.3f}"]
        for name, said in GUARD_FIGURES
        if f"baseline_{name}" in m and f"candidate_{name}" in m
    ]
    figure_head = ["guard figure", "baseline", "candidate"]

    def rows_html(rows: list[list[str]]) -> str:
        return "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)

    def head_html(names: list[str]) -> str:
        return "<tr>" + "".join(f"<th>{h}</th>" for h in names) + "</tr>\n"

    guards_html = (
        f"<h2>Guard figures</h2><table>\n{head_html(figure_head)}{rows_html(figures)}</table>" if figures else ""
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kubealign evaluation samples</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #999;"
        "padding:4px;vertical-align:top;white-space:pre-wrap}</style></head><body>"
        f"<h1>Evaluation samples</h1>{guards_html}<table>\n{head_html(head)}{rows_html(cells)}</table></body></html>\n"
    )

    def md(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    def md_table(names: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(names) + " |",
            "|" + "---|" * len(names),
            *("| " + " | ".join(md(c) for c in r) + " |" for r in rows),
        ]

    lines = [*md_table(figure_head, figures), ""] if figures else []
    return page, "\n".join([*lines, *md_table(head, cells)]) + "\n"


def plots(directory: Path, base: list[dict], cand: list[dict], history: list[dict] | None) -> list[str]:
    """PNG plots: reward distributions, and the PPO training curves when a history is available."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([r["score"] for r in base], bins=20, alpha=0.6, label="baseline (SFT)")
    ax.hist([r["score"] for r in cand], bins=20, alpha=0.6, label="candidate")
    ax.set(xlabel="score (reward model and / or reward functions)", ylabel="responses", title="Reward distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "reward_distribution.png", dpi=100)
    plt.close(fig)
    made = ["reward_distribution.png"]
    if history:
        fig, axes = plt.subplots(2, 2, figsize=(9, 6))
        steps = [h["iteration"] for h in history]
        # the fourth panel: the critic's loss for PPO; GRPO and RLOO have no critic but a group spread
        fourth = "value_loss" if "value_loss" in history[0] else "group_reward_std"
        for ax, key in zip(axes.flat, ("reward_mean", "kl", "policy_loss", fourth), strict=True):
            ax.plot(steps, [h.get(key, float("nan")) for h in history])
            ax.set(title=key, xlabel="iteration")
        fig.tight_layout()
        fig.savefig(directory / "ppo_curves.png", dpi=100)
        plt.close(fig)
        made.append("ppo_curves.png")
    return made


def check_inputs(config: KubealignConfig, prompts: Path, baseline: Path, candidate: Path, reward: Path | None) -> None:
    """Two policies and a reward model when rewards use one (the same check as ppo's: a causal LM given as
    --reward would get a random score head), and lengths that fit every model: prompts are cut to
    ppo.max_prompt_len and get up to evaluate.max_new_tokens more; the perplexity rows are cut to sft.max_seq_len."""
    if config.rewards.uses_model and reward is None:
        raise UserError(
            f"evaluate: --reward RM_DIR is needed: rewards.model_weight is {config.rewards.model_weight:g}"
            f"{'' if config.rewards.functions else ' and no rewards.functions are set'}; for reward functions alone "
            "set rewards.model_weight: 0"
        )
    wanted = [
        ("--baseline", baseline, "ForCausalLM", "baseline"),
        ("--candidate", candidate, "ForCausalLM", "candidate"),
    ]
    if config.rewards.uses_model:
        wanted.append(("--reward", reward, "ForSequenceClassification", "reward model"))
    configs = {flag: loading.model_dir_config(flag, path, kind) for flag, path, kind, _ in wanted}
    total = config.ppo.max_prompt_len + config.evaluate.max_new_tokens
    for flag, _, _, role in wanted:
        loading.check_fits("ppo.max_prompt_len + evaluate.max_new_tokens", total, role, flag, configs[flag])
    if (Path(prompts) / "phase1_sft").is_dir():
        for flag, _, _, role in wanted[:2]:
            loading.check_fits("sft.max_seq_len", config.sft.max_seq_len, role, flag, configs[flag])


def run(
    config: KubealignConfig,
    prompts: Path,
    baseline: Path,
    candidate: Path,
    reward: Path | None,
    output: Path,
    functions: list[definitions.FunctionSpec] | None = None,
) -> dict[str, Any]:
    """functions: the reward functions as a pipeline task was handed them (source embedded); None = resolved
    from config.rewards. reward: the reward model dir, when rewards use one (else ignored)."""
    cfg = config.evaluate
    check_output_path(output, STAGE)
    check_inputs(config, prompts, baseline, candidate, reward)
    reward = reward if config.rewards.uses_model else None
    specs = definitions.resolve_all(config.rewards, config.tools, config.base_dir) if functions is None else functions
    definitions.check_matches(specs, config.rewards, config.tools)
    split = phases.load(prompts, "phase3_prompts")
    rows = split["eval"] if len(split["eval"]) else split["train"]
    started = time.perf_counter()
    r = config.rewards
    runner = FunctionRunner.for_config(specs, r) if specs else None
    with stage_run(STAGE, config, output.resolve().parent, required=False) as tracker, runner or nullcontext():
        tracker.log_inputs([ref] if (ref := phase_ref(prompts, "phase3_prompts", "evaluation")) else [])
        tokenizer = loading.load_tokenizer(str(baseline))
        data = phases.prompt_rows(rows)
        data = data.take(list(range(min(cfg.max_prompts, len(data.prompts)))))
        texts = data.prompts
        cap, bos = config.ppo.max_prompt_len, tokenizer.bos_token_id  # cut as PPO cuts its prompts
        encoded = [cut_left(encode_prompt(tokenizer, p), cap, bos) for p in texts]
        base_model = loading.load_causal_lm(str(baseline)).eval()
        cand_model = loading.load_causal_lm(str(candidate)).eval()
        reward_model = None
        if reward is not None:
            reward_model = load_reward_model(str(reward), False, tokenizer.pad_token_id, "fp32").eval()
        scorer = Scorer(reward_model, config.rewards.model_weight if specs else 1.0, runner, tokenizer)
        base, cand = sampled(config, runner, tokenizer, encoded, data, (base_model, cand_model))
        score(scorer, base, cfg.batch_size, data)
        score(scorer, cand, cfg.batch_size, data)
        metrics = compare(base, cand, cfg.seed)
        metrics.update(evaluate_turns.turn_figures(base, cand))
        metrics.update(heldout_figures(reward, tokenizer, base, cand, cfg.batch_size))
        metrics.update(function_means_by_model(base, cand))
        metrics["kl_to_baseline"] = kl_to(cand_model, base_model, cand, cfg.batch_size, Sampling.of(cfg))
        metrics.update(
            guard_figures(config, prompts, tokenizer, {"baseline": (base_model, base), "candidate": (cand_model, cand)})
        )
        table = sample_table(tokenizer, texts, base, cand)
        metrics.update(judged(config, table))
        metrics.update(llm_judged(cfg, table))
        metrics.update(
            suites.run(cfg.suites, config.base_dir, {"baseline": base_model, "candidate": cand_model}, tokenizer)
        )
        history = read_history(candidate)
        metrics["wall_time_s"] = time.perf_counter() - started
        with atomic_dir(output) as tmp:
            page, markdown = sample_tables(table[: cfg.sample_rows], metrics)
            (tmp / "samples.html").write_text(page, encoding="utf-8")
            (tmp / "samples.md").write_text(markdown, encoding="utf-8")
            write_json(tmp / "eval_samples.json", table)
            pngs = plots(tmp, base, cand, history)
            outputs = {"samples_html": "samples.html", "samples_md": "samples.md", "samples": "eval_samples.json"}
            outputs.update({name.removesuffix(".png"): name for name in pngs})
            paths = {
                "baseline": str(baseline),
                "candidate": str(candidate),
                "reward": None if reward is None else str(reward),
                "prompts": str(prompts),
            }
            result = write_result(tmp, STAGE, metrics, outputs, models=paths)
        tracker.log_metrics(metrics)
        for name in ["samples.html", "samples.md", "eval_samples.json", *pngs]:
            tracker.log_artifact(output / name, STAGE)
    return {**result, "output": str(output), "run_id": tracker.run_id}


def read_history(candidate: Path) -> list[dict] | None:
    try:
        result = json.loads((Path(candidate) / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return result.get("history") if result.get("stage") == "ppo" else None  # only a PPO run has these curves
