"""Stage 4, evaluate: the PPO candidate against the SFT baseline on held-out phase-3 prompts.

Both models sample from the same prompts with the same seeded settings (evaluate section; answers.sampling);
the scorer (rewards.scorer: the reward model at each response's EOS and / or the reward functions, weighted)
scores every response (answers.scoring), and each reward function's mean over the rows it applies to is reported
as fn/<NAME>/baseline and fn/<NAME>/candidate. Metrics: mean reward of each, win-rate of the candidate (ties
counted separately), KL(candidate || baseline) estimated on the candidate's samples, response lengths,
phase-1 eval perplexity of each (and its log, the held-out log-likelihood per token), and the figures the
promotion guards read (kubealign.promotion.guards): repeated-bigram rate, distinct-2, empty and unfinished
answers, length drift, the held-out reward model's, with tools the tool-use figures (answers.turns), on the
synthetic task its grammar's grade (answers.grades), when evaluate.llm_judge.url is set an LLM judge's verdicts
in both orders (answers.llm_judge), and when evaluate.suites names tasks, both models' scores on those
lm-eval-harness suites (answers.suites). Output (atomic; stages.evaluate_report): result.json, samples.html /
samples.md (the first `sample_rows` prompts), eval_samples.json (every row), reward_distribution.png and, when
the candidate's result.json has a PPO history, ppo_curves.png.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kubealign.answers import suites, turns
from kubealign.answers.grades import graded
from kubealign.answers.llm_judge import llm_judged
from kubealign.answers.sampling import sampled
from kubealign.answers.scoring import guard_figures, heldout_figures, kl_to, score
from kubealign.config import KubealignConfig
from kubealign.data import phases
from kubealign.data.tokenize import cut_left, encode_prompt
from kubealign.errors import UserError
from kubealign.feedback import fresh
from kubealign.models import loading
from kubealign.models.value_head import load_reward_model
from kubealign.outputs import atomic_dir, check_output_path, write_json, write_result
from kubealign.rewards.scorer import Scorer
from kubealign.rl.losses import Sampling
from kubealign.selection.comparison import compare, function_means_by_model
from kubealign.stages.evaluate_report import plots, read_history, sample_table, sample_tables
from kubealign.tracking.lineage import phase_ref
from kubealign.tracking.runs import stage_run
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner

STAGE = "evaluate"


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
    runner = FunctionRunner.for_config(specs, config.rewards) if specs else None
    with stage_run(STAGE, config, output.resolve().parent, required=False) as tracker, runner or nullcontext():
        tracker.log_inputs([ref] if (ref := phase_ref(prompts, "phase3_prompts", "evaluation")) else [])
        # setup: the prompts cut as PPO cuts its prompts, both policies, the scorer
        tokenizer = loading.load_tokenizer(str(baseline))
        data = phases.prompt_rows(rows)
        data = data.take(list(range(min(cfg.max_prompts, len(data.prompts)))))
        cap, bos = config.ppo.max_prompt_len, tokenizer.bos_token_id
        encoded = [cut_left(encode_prompt(tokenizer, p), cap, bos) for p in data.prompts]
        models = {"baseline": loading.load_causal_lm(str(baseline)).eval()}
        models["candidate"] = loading.load_causal_lm(str(candidate)).eval()
        reward_model = None
        if reward is not None:
            reward_model = load_reward_model(str(reward), False, tokenizer.pad_token_id, "fp32").eval()
        scorer = Scorer(reward_model, config.rewards.model_weight if specs else 1.0, runner, tokenizer)
        base, cand = answers_of(config, runner, scorer, tokenizer, encoded, data, tuple(models.values()))
        metrics, table = figures(config, prompts, reward, tokenizer, models, (base, cand), data.prompts)
        metrics["wall_time_s"] = time.perf_counter() - started
        paths = {"baseline": baseline, "candidate": candidate, "reward": reward, "prompts": prompts}
        result, made = save(output, cfg.sample_rows, metrics, table, (base, cand), paths)
        tracker.log_metrics(metrics)
        for name in made:
            tracker.log_artifact(output / name, STAGE)
    return {**result, "output": str(output), "run_id": tracker.run_id}


def answers_of(
    config: KubealignConfig, runner: Any, scorer: Scorer, tokenizer: Any, encoded: list, data: Any, models: tuple
) -> tuple:
    """Each model's sample rows, sampled (with the tools, in turns) and scored, each model in a fresh worker: what
    the user's tools, environment or reward functions keep in their modules and classes from one model's turns
    and scores cannot change the next model's (measured before: the same actions scored 2.0 as the baseline's
    and 4.0 as the candidate's)."""
    out = []
    for i, model in enumerate(models):
        if runner is not None and i:
            runner.restart()
        (rows,) = sampled(config, runner, tokenizer, encoded, data, (model,))
        score(scorer, rows, config.evaluate.batch_size, data)
        out.append(rows)
    return tuple(out)


def figures(
    config: KubealignConfig,
    prompts: Path,
    reward: Path | None,
    tokenizer: Any,
    models: dict[str, Any],
    answers: tuple[list[dict], list[dict]],
    texts: list[str],
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(every metric of the evaluation, eval_samples.json's table), from both models ({"baseline", "candidate"}),
    their scored sample rows and the prompts' texts. The table is made after the held-out reward model scored
    the rows (its scores are columns) and before the grammar and the LLM judge read the decoded answers (the LLM
    judge writes each row's verdict into it)."""
    cfg, (base, cand) = config.evaluate, answers
    metrics = compare(base, cand, cfg.seed)
    metrics.update(turns.turn_figures(base, cand))
    metrics.update(heldout_figures(reward, tokenizer, base, cand, cfg.batch_size))
    metrics.update(fresh.of_reward_dir(reward))  # the reward models' check against people, for promote's gate
    metrics.update(function_means_by_model(base, cand))
    metrics["kl_to_baseline"] = kl_to(models["candidate"], models["baseline"], cand, cfg.batch_size, Sampling.of(cfg))
    pairs = {"baseline": (models["baseline"], base), "candidate": (models["candidate"], cand)}
    metrics.update(guard_figures(config, prompts, tokenizer, pairs))
    table = sample_table(tokenizer, texts, base, cand)
    metrics.update(graded(config, table))
    metrics.update(llm_judged(cfg, table))
    metrics.update(suites.run(cfg.suites, config.base_dir, models, tokenizer))
    return metrics, table


def save(
    output: Path,
    sample_rows: int,
    metrics: dict[str, float],
    table: list[dict[str, Any]],
    answers: tuple[list[dict], list[dict]],
    paths: dict[str, Path | None],
) -> tuple[dict[str, Any], list[str]]:
    """(result.json's content, the files written): the report (stages.evaluate_report) and result.json, atomically
    in OUTPUT. paths: the models and prompts evaluated, as result.json names them."""
    with atomic_dir(output) as tmp:
        page, markdown = sample_tables(table[:sample_rows], metrics)
        (tmp / "samples.html").write_text(page, encoding="utf-8")
        (tmp / "samples.md").write_text(markdown, encoding="utf-8")
        write_json(tmp / "eval_samples.json", table)
        pngs = plots(tmp, *answers, read_history(Path(paths["candidate"])))
        outputs = {"samples_html": "samples.html", "samples_md": "samples.md", "samples": "eval_samples.json"}
        outputs.update({name.removesuffix(".png"): name for name in pngs})
        models = {who: None if path is None else str(path) for who, path in paths.items()}
        result = write_result(tmp, STAGE, metrics, outputs, models=models)
    return result, ["samples.html", "samples.md", "eval_samples.json", *pngs]
