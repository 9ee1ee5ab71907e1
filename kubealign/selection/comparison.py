"""The paired comparison of two policies' scored responses to the same prompts, as evaluate reports it: pure
functions of the rows (each {"score", "tokens", "fn"}), no models. Win / tie / loss rates with the win-rate's
percentile-bootstrap interval, each model's reward mean, lengths and repeated-bigram rate, and each reward
function's mean over the rows it applies to."""

from __future__ import annotations

import torch

from kubealign.rewards import totals

TIE = 1e-6  # score differences within this are ties: the same response scores the same up to rounding


def repetition_rate(tokens: list[int]) -> float:
    """Share of a response's bigrams that already occurred earlier in it (0 = no repetition)."""
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    return 1 - len(set(bigrams)) / len(bigrams) if bigrams else 0.0


def bootstrap_interval(
    outcomes: list[float], seed: int, level: float = 0.95, resamples: int = 2000
) -> tuple[float, float]:
    """The two-sided percentile-bootstrap interval of the mean of `outcomes` (per-prompt win indicators):
    a few dozen prompts make the point estimate noisy, so a gate can ask for the lower end and the
    leaderboard shows both."""
    if not outcomes:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor(outcomes, dtype=torch.float64)
    picks = torch.randint(len(outcomes), (resamples, len(outcomes)), generator=generator)
    means = values[picks].mean(dim=1)
    ends = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(ends[0]), float(ends[1])


def bootstrap_lower_bound(outcomes: list[float], seed: int, level: float = 0.95, resamples: int = 2000) -> float:
    """Lower end of bootstrap_interval."""
    return bootstrap_interval(outcomes, seed, level, resamples)[0]


def compare(base: list[dict], cand: list[dict], seed: int = 0) -> dict[str, float]:
    """The candidate's rows against the baseline's, row i of each answering prompt i: win / tie / loss rates
    of the candidate's score, the win-rate's 95 % bootstrap interval (seeded), and per model the reward mean,
    the response length's mean, median (the upper one of an even count) and max, and the repeated-bigram
    rate; reward_gain = candidate - baseline reward mean, length_drift = candidate / baseline mean length."""
    n = len(base)
    diffs = [c["score"] - b["score"] for b, c in zip(base, cand, strict=True)]
    wins, ties = sum(d > TIE for d in diffs), sum(abs(d) <= TIE for d in diffs)
    metrics = {"win_rate": wins / n, "tie_rate": ties / n, "loss_rate": (n - wins - ties) / n, "prompts": n}
    interval = bootstrap_interval([float(d > TIE) for d in diffs], seed)
    metrics["win_rate_lower_bound"], metrics["win_rate_upper_bound"] = interval
    for name, rows in (("baseline", base), ("candidate", cand)):
        lengths = sorted(len(r["tokens"]) for r in rows)
        metrics[f"{name}_reward_mean"] = sum(r["score"] for r in rows) / n
        metrics[f"{name}_length_mean"] = sum(lengths) / n
        metrics[f"{name}_length_median"] = float(lengths[n // 2])
        metrics[f"{name}_length_max"] = float(lengths[-1])
        metrics[f"{name}_repetition_rate"] = sum(repetition_rate(r["tokens"]) for r in rows) / n
    metrics["reward_gain"] = metrics["candidate_reward_mean"] - metrics["baseline_reward_mean"]
    metrics["length_drift"] = metrics["candidate_length_mean"] / max(metrics["baseline_length_mean"], 1e-9)
    return metrics


def degeneration(rows: list[dict], eos_id: int | None, prefix: str) -> dict[str, float]:
    """The answers' own figures the guards read (kubealign.promotion.guards), each row's "tokens" being its
    answer with the EOS when the model ended it: {prefix}_distinct_2 (distinct bigrams over all bigrams of
    every answer, the EOS left out: Li et al. 2016's distinct-n; one answer to every prompt scores near 0),
    {prefix}_empty_rate (answers with no token but the EOS) and {prefix}_unfinished_rate (answers that
    never reached the EOS: cut at the token limit)."""
    answers = [r["tokens"][:-1] if r["tokens"] and r["tokens"][-1] == eos_id else r["tokens"] for r in rows]
    bigrams = [pair for a in answers for pair in zip(a, a[1:], strict=False)]
    n = max(len(rows), 1)
    return {
        f"{prefix}_distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 0.0,
        f"{prefix}_empty_rate": sum(not a for a in answers) / n,
        f"{prefix}_unfinished_rate": sum(not r["tokens"] or r["tokens"][-1] != eos_id for r in rows) / n,
    }


def function_means_by_model(base: list[dict], cand: list[dict]) -> dict[str, float]:
    """fn/<NAME>/baseline and fn/<NAME>/candidate: each reward function's mean over the responses it applies to
    (a None is left out); a function that applies to none of a model's responses gets no metric."""
    metrics: dict[str, float] = {}
    for label, rows in (("baseline", base), ("candidate", cand)):
        values = {name: [r["fn"][name] for r in rows] for name in (rows[0].get("fn", {}) if rows else ())}
        metrics.update(totals.function_means(totals.function_totals(values), f"/{label}"))
    return metrics


def heldout_comparison(base: list[dict], cand: list[dict]) -> dict[str, float]:
    """The held-out reward model's view of the same pairs (rows carry "heldout_score" beside "score"): its
    win-rate (promote.guards.min_heldout_win_rate), tie rate, each model's mean and the gain, and
    reward_agreement: the share of prompts on which both scorers call the same winner (a tie is a call of its
    own). The training reward up while the held-out one is flat or down is the signature of reward hacking;
    two scorers that judge alike agree near 1."""
    n = max(len(base), 1)

    def call(diff: float) -> int:
        return 0 if abs(diff) <= TIE else (1 if diff > 0 else -1)

    held = [c["heldout_score"] - b["heldout_score"] for b, c in zip(base, cand, strict=True)]
    trained = [c["score"] - b["score"] for b, c in zip(base, cand, strict=True)]
    metrics = {
        "heldout_win_rate": sum(call(d) > 0 for d in held) / n,
        "heldout_tie_rate": sum(call(d) == 0 for d in held) / n,
        "baseline_heldout_reward_mean": sum(b["heldout_score"] for b in base) / n,
        "candidate_heldout_reward_mean": sum(c["heldout_score"] for c in cand) / n,
        "reward_agreement": sum(call(h) == call(t) for h, t in zip(held, trained, strict=True)) / n,
    }
    metrics["heldout_reward_gain"] = metrics["candidate_heldout_reward_mean"] - metrics["baseline_heldout_reward_mean"]
    return metrics
