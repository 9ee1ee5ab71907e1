"""The online judge's figures and decision. Pure: answers and scores in, numbers and a verdict out.

The judge sends the same held-out prompts to the champion's and the canary's endpoints (kubealign.serving.ask),
scores both answers with the reward model and functions evaluate uses, and compares them with evaluate's
statistics (kubealign.selection.comparison.compare, the champion in the baseline's place). The canary is promoted only
if (1) at least `canary.min_answers` prompts were answered by both, (2) its error rate and latency stay within
`canary.max_error_rate` and `canary.max_latency_p95_s`, and (3) the promote section's gate passes on the online
numbers (kubealign.promotion.gate: win-rate over the champion, its bound, reward gain, and the guards that
served answers can feed: degeneration against the champion's answers, the held-out reward model's win-rate
and, when evaluate.llm_judge.url is set, the LLM judge's, each "min_win_rate" bar promote.min_win_rate as
offline). KL to the champion and held-out capability are not measured online: a configured promote.max_kl or
guard is said to be unchecked, not failed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kubealign.config.canary import CanaryConfig
from kubealign.config.schema import PromoteConfig


@dataclass(frozen=True)
class Answer:
    """One request's outcome: the completion's text, or `error` (one line: "HTTP 500", "timeout", "refused",
    "garbage: ..."); latency_s is the client's wall time for the request, answered or not."""

    prompt: int
    text: str | None
    latency_s: float
    error: str | None = None
    finished: bool = True  # the model ended its answer (finish_reason stop), not max_tokens

    @property
    def ok(self) -> bool:
        return self.error is None


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of values: the smallest value with at least q % of them
    at or below it; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]


def serving_figures(answers: Sequence[Answer]) -> dict[str, float]:
    """requests, errors, error_rate and latency p50 / p95 / p99 (seconds, answered requests only), and
    errors/<kind> counts (the error's text before any ':')."""
    latencies = [a.latency_s for a in answers if a.ok]
    errors = [a.error for a in answers if a.error is not None]
    figures = {
        "requests": float(len(answers)),
        "errors": float(len(errors)),
        "error_rate": len(errors) / len(answers) if answers else math.nan,
        **{f"latency_p{q}_s": percentile(latencies, q) for q in (50, 95, 99)},
    }
    for kind, count in Counter(e.split(":")[0] for e in errors).items():
        figures[f"errors/{kind}"] = float(count)
    return figures


def answered_pairs(champion: Sequence[Answer], canary: Sequence[Answer]) -> list[int]:
    """The prompts both models answered, in order."""
    theirs = {a.prompt for a in champion if a.ok}
    return sorted(a.prompt for a in canary if a.ok and a.prompt in theirs)


@dataclass(frozen=True)
class HumanFeedback:
    """People's verdict on the canary's version (the latest `kubealign feedback pull` for it)."""

    win_rate: float  # of the canary's version over the other side, over the decided tasks
    decided: int  # tasks with a majority
    source: str  # where it was read (the feedback run)


def decide(
    online: dict[str, float] | None,
    pairs: int,
    canary_figures: dict[str, float],
    promote: PromoteConfig,
    cfg: CanaryConfig,
    human: HumanFeedback | None = None,
) -> tuple[bool, list[str]]:
    """(promote the canary?, one line per check, "pass: " or "FAIL: " first). online: compare()'s metrics of
    the canary's scored answers against the champion's, with the guards' figures of those answers (the LLM
    judge's llm_judge_* when one judged: no figures, no line), None when too few pairs to compute them.
    human: people's verdict, read when canary.min_human_win_rate is set (none found: that check fails)."""
    from kubealign.promotion.gate import gate
    from kubealign.promotion.guards import needs

    answered = needs("prompts answered by both", f">= canary.min_answers {cfg.min_answers}", str(pairs))
    checks = [(pairs >= cfg.min_answers, answered)]
    if cfg.min_human_win_rate is not None:
        bar = cfg.min_human_win_rate
        if human is None or human.decided == 0:
            checks.append(
                (False, needs("people's win-rate", f">= canary.min_human_win_rate {bar}", "no decided feedback"))
            )
        else:
            what, rate_of = f"people's win-rate over {human.decided} tasks", f"{human.win_rate:.3f}"
            text = needs(what, f">= canary.min_human_win_rate {bar}", rate_of, human.source)
            checks.append((human.win_rate >= bar, text))
    rate = canary_figures["error_rate"]
    checks.append((rate <= cfg.max_error_rate, needs("canary error_rate", f"<= {cfg.max_error_rate}", f"{rate:.3f}")))
    if cfg.max_latency_p95_s is not None:
        p95 = canary_figures["latency_p95_s"]
        bound = f"<= {cfg.max_latency_p95_s} s"
        checks.append((p95 <= cfg.max_latency_p95_s, needs("canary latency_p95", bound, f"{p95:.3f} s")))
    lines = [("pass: " if ok else "FAIL: ") + text for ok, text in checks]
    if online is None or pairs < cfg.min_answers:
        return False, [*lines, "FAIL: the gate: not applied on too few answers"]
    # The champion is the baseline online: beating it is the win-rate itself, not a second check.
    online_cfg = promote.model_copy(update={"max_kl": None, "require_beat_champion": False})
    # people's check above is a judge the others are measured against: with every automatic judge distrusted, the
    # gate leans on it alone
    people = cfg.min_human_win_rate is not None and human is not None and human.decided > 0
    passed, gated = gate(online, online_cfg, None, people)
    if promote.max_kl is not None:
        gated.append(f"unchecked: promote.max_kl {promote.max_kl} (KL to the champion is not measured online)")
    return all(ok for ok, _ in checks) and passed, [*lines, *gated]


def awaits_people(
    online: dict[str, float] | None,
    pairs: int,
    canary_figures: dict[str, float],
    promote: PromoteConfig,
    cfg: CanaryConfig,
    human: HumanFeedback | None,
) -> bool:
    """Whether the verdict waits for people (canary.await_people): they have not decided on the canary yet, and
    their approval is all it lacks, decide() passing it with any win-rate at the bar. A canary that fails a check
    people cannot mend (errors, latency, too few answers, the gate without them) is rolled back now."""
    if not cfg.await_people or cfg.min_human_win_rate is None or (human is not None and human.decided > 0):
        return False
    approval = HumanFeedback(cfg.min_human_win_rate, 1, "people, once they decide")
    return decide(online, pairs, canary_figures, promote, cfg, approval)[0]


def awaiting_line(version: str, alias: str = "challenger") -> str:
    """The line of a verdict that waits for people."""
    return (
        f"judge: {alias} (version {version}) awaits people's choices (canary.await_people): it keeps serving its "
        "share until the pipeline's next run settles it"
    )


def verdict_line(promoted: bool, lines: Sequence[str], alias: str, version: str) -> str:
    """The one line a person reads: what happened and, for a rollback, the first reason."""
    if promoted:
        return f"judge: {alias} (version {version}) holds online: promoted to champion"
    failed = next((line.removeprefix("FAIL: ") for line in lines if line.startswith("FAIL: ")), "no reason")
    return f"judge: {alias} (version {version}) rolled back: {failed}"


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """Prometheus's histogram_quantile: the q-quantile (0..1) of a histogram given as (upper bound, cumulative
    count) pairs, by linear interpolation inside the bucket where the rank q * total falls (its lower bound the
    previous bucket's, 0 for the first); in the +Inf bucket, the highest finite bound. NaN for no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
