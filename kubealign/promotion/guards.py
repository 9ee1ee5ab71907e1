"""The guards the optimized reward model cannot fool: pure checks of an evaluation's figures,
the candidate's against the baseline's on the same held-out prompts, under promote.guards' thresholds:
capability kept, the held-out reward model's win-rate, the LLM judge's (when one judged), the benchmark suites'
(when evaluate.suites named any), no degeneration.

The gate (kubealign.promotion.gate) adds them to its reward checks; the compare stage keeps a candidate
that fails one from leading; the online judge applies those it can compute from served answers. The figures
come from evaluate (kubealign.answers: scoring for the held-out log-likelihood, the held-out reward model and
the answers' degeneration, llm_judge, suites for lm-eval's results)."""

from __future__ import annotations

from typing import NamedTuple

from kubealign.config.guards import GuardsConfig


class Check(NamedTuple):
    """One guard's outcome: ok None = not checked (its figures absent: said, never counted as a failure); trusted
    False = its judge disagrees with people (min_judge_agreement): reported, not counted."""

    ok: bool | None
    text: str
    trusted: bool = True

    @property
    def line(self) -> str:
        if not self.trusted:
            return "not trusted: " + self.text
        return {True: "pass: ", False: "FAIL: ", None: "unchecked: "}[self.ok] + self.text

    @property
    def counted(self) -> bool:
        """Whether the gate counts it: a failed check of a trusted judge fails the gate."""
        return self.trusted and self.ok is not None


def needs(what: str, needed: str, got: str, said: str = "") -> str:
    """The one form of every gate and guard line: what was needed, then what was measured, e.g.
    "win_rate: needs >= 0.5, got 0.400" (never the requirement written as if it were the fact)."""
    return f"{what}: needs {needed}, got {got}" + (f" ({said})" if said else "")


def credited(metrics: dict[str, float], rate: str, ties: str, credit: float) -> tuple[float, str]:
    """(the win-rate `rate` with each tie counted `credit` of a win (promote.tie_credit), how it was counted);
    the strict win-rate and "" when credit is 0 or the metrics have no tie rate."""
    tied = metrics.get(ties)
    if not credit or tied is None:
        return metrics[rate], ""
    return metrics[rate] + credit * tied, f"wins {metrics[rate]:.3f} + {credit} x ties {tied:.3f}"


def _sides(base: float, cand: float) -> str:
    return f"baseline {base:.3f}, candidate {cand:.3f}"


FIGURES = {  # each guard's field and the figures (baseline_<name> and candidate_<name>) it reads
    "max_logprob_drop": "heldout_logprob",
    "max_repetition_rise": "repetition_rate",
    "min_distinct_ratio": "distinct_2",
    "max_empty_rise": "empty_rate",
    "max_unfinished_rise": "unfinished_rate",
    "min_length_ratio": "length_mean",
    "max_length_ratio": "length_mean",
}
HELDOUT_FIGURES = (  # the held-out reward model's (min_heldout_win_rate reads the first)
    "heldout_win_rate",
    "reward_agreement",
    "heldout_reward_gain",
    "baseline_heldout_reward_mean",
    "candidate_heldout_reward_mean",
)
LLM_JUDGE_FIGURES = (  # the LLM judge's (kubealign.answers.llm_judge; min_llm_judge_win_rate reads the first)
    "llm_judge_win_rate",
    "llm_judge_loss_rate",
    "llm_judge_tie_rate",
    "llm_judge_unparsed",
    "llm_judge_position_bias",
)
SUITE_PREFIX = "suite_"  # baseline_suite_<task> / candidate_suite_<task>: evaluate.suites' (answers.suites)


def suite_pairs(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{task: (baseline, candidate)} of every suite in `metrics`, in name order."""
    names = sorted(
        k.removeprefix(f"baseline_{SUITE_PREFIX}") for k in metrics if k.startswith(f"baseline_{SUITE_PREFIX}")
    )
    pairs = {name: _pair(metrics, f"{SUITE_PREFIX}{name}") for name in names}
    return {name: pair for name, pair in pairs.items() if pair is not None}


def heldout_applies(metrics: dict[str, float]) -> bool:
    """The held-out reward model judges only where a reward model scored (reward functions alone: no model
    the policy could exploit the blind spots of; evaluate says so with reward_model_used 0)."""
    return metrics.get("reward_model_used", 1.0) != 0.0


def missing(metrics: dict[str, float], cfg: GuardsConfig) -> dict[str, list[str]]:
    """The guards that are on and whose figures `metrics` lacks: {field: [metric, ...]}. Never the LLM judge's:
    it is optional (evaluate.llm_judge), so an evaluation without its figures has nothing for it to check."""
    wanted = {f: [f"{who}_{FIGURES[f]}" for who in ("baseline", "candidate")] for f in FIGURES}
    if cfg.min_heldout_win_rate is not None and heldout_applies(metrics):
        wanted["min_heldout_win_rate"] = [HELDOUT_FIGURES[0]]
    lacking = {f: [m for m in names if m not in metrics] for f, names in wanted.items() if getattr(cfg, f) is not None}
    return {f: names for f, names in lacking.items() if names}


def recorded(metrics: dict[str, float]) -> list[str]:
    """The guard figures present in `metrics`, for the registry's version tags."""
    pairs = [f"{who}_{name}" for name in dict.fromkeys(FIGURES.values()) for who in ("baseline", "candidate")]
    suites = sorted(m for m in metrics if m.startswith((f"baseline_{SUITE_PREFIX}", f"candidate_{SUITE_PREFIX}")))
    return [m for m in [*pairs, *HELDOUT_FIGURES, *LLM_JUDGE_FIGURES] if m in metrics] + suites


def _pair(metrics: dict[str, float], name: str) -> tuple[float, float] | None:
    base, cand = metrics.get(f"baseline_{name}"), metrics.get(f"candidate_{name}")
    return None if base is None or cand is None else (float(base), float(cand))


def checks(metrics: dict[str, float], cfg: GuardsConfig, min_win_rate: float, tie_credit: float = 0.0) -> list[Check]:
    """Every configured guard, in a fixed order: capability first (it says the most), the held-out reward
    model, then degeneration. min_win_rate: promote.min_win_rate (min_heldout_win_rate "min_win_rate");
    tie_credit: promote.tie_credit (the held-out model's ties)."""
    out: list[Check] = []
    if cfg.max_logprob_drop is not None:
        pair = _pair(metrics, "heldout_logprob")
        if pair is None:
            out.append(Check(None, "capability: no held-out log-likelihood measured"))
        else:
            base, cand = pair
            drop = base - cand
            ok = drop <= cfg.max_logprob_drop
            what = "capability: held-out log-likelihood per token drop"
            out.append(Check(ok, needs(what, f"<= {cfg.max_logprob_drop}", f"{drop:.3f}", _sides(base, cand))))
    out += heldout_checks(metrics, cfg, min_win_rate, tie_credit)
    out += llm_judge_checks(metrics, cfg, min_win_rate)
    out += suite_checks(metrics, cfg)
    out += degeneration_checks(metrics, cfg)
    return out


def heldout_checks(
    metrics: dict[str, float], cfg: GuardsConfig, min_win_rate: float, tie_credit: float = 0.0
) -> list[Check]:
    """min_heldout_win_rate: the independent scorer's win-rate (its ties counted tie_credit of a win), with how often
    it agreed with the training one."""
    floor = min_win_rate if cfg.min_heldout_win_rate == "min_win_rate" else cfg.min_heldout_win_rate
    if floor is None or not heldout_applies(metrics):
        return []
    if metrics.get("heldout_win_rate") is None:
        return [Check(None, "held-out reward model: none scored the answers")]
    rate, counted = credited(metrics, "heldout_win_rate", "heldout_tie_rate", tie_credit)
    ok = rate >= floor
    agree = metrics.get("reward_agreement")
    said = "" if agree is None else f"agrees with the training reward model on {agree:.0%} of the prompts"
    said = "; ".join(s for s in (counted, said) if s)
    return [Check(ok, needs("held-out reward model: win-rate", f">= {floor}", f"{rate:.3f}", said))]


def llm_judge_checks(metrics: dict[str, float], cfg: GuardsConfig, min_win_rate: float) -> list[Check]:
    """min_llm_judge_win_rate: the share of prompts the LLM judge gave the candidate in both orders; no line at
    all when the evaluation had no judge."""
    floor = min_win_rate if cfg.min_llm_judge_win_rate == "min_win_rate" else cfg.min_llm_judge_win_rate
    rate = metrics.get(LLM_JUDGE_FIGURES[0])
    if floor is None or rate is None:
        return []
    ok = rate >= floor
    bias = metrics.get("llm_judge_position_bias")
    said = "" if bias is None else f"position bias {bias:.2f}"
    return [Check(ok, needs("llm judge: win-rate in both orders", f">= {floor}", f"{rate:.3f}", said))]


def suite_checks(metrics: dict[str, float], cfg: GuardsConfig) -> list[Check]:
    """max_suite_drop: each benchmark suite's score may fall at most this far below the baseline's; no line when
    the evaluation ran no suite (evaluate.suites is optional)."""
    if cfg.max_suite_drop is None:
        return []
    out = []
    for name, (base, cand) in suite_pairs(metrics).items():
        drop = base - cand
        ok = drop <= cfg.max_suite_drop
        said = _sides(base, cand)
        out.append(Check(ok, needs(f"suites: {name} drop", f"<= {cfg.max_suite_drop}", f"{drop:.3f}", said)))
    return out


def _measured(metrics: dict[str, float], name: str, said: str, out: list[Check]) -> tuple[float, float] | None:
    """Both models' figure `name`, or None after saying in `out` that the evaluation has none."""
    pair = _pair(metrics, name)
    if pair is None:
        out.append(Check(None, f"degeneration: no {said} in the evaluation"))
    return pair


def degeneration_checks(metrics: dict[str, float], cfg: GuardsConfig) -> list[Check]:
    """The answers' figures: rises (candidate - baseline) and ratios (candidate / baseline) within limits."""
    out: list[Check] = []
    rises = (
        ("repetition_rate", "repeated-bigram rate", cfg.max_repetition_rise),
        ("empty_rate", "empty answers", cfg.max_empty_rise),
        ("unfinished_rate", "unfinished answers", cfg.max_unfinished_rise),
    )
    for name, said, limit in rises:
        if limit is None:
            continue
        pair = _measured(metrics, name, said, out)
        if pair is None:
            continue
        base, cand = pair
        ok = cand - base <= limit
        rise = f"{cand - base:.3f}"
        out.append(Check(ok, needs(f"degeneration: {said} rise", f"<= {limit}", rise, _sides(base, cand))))
    ratios = (
        ("distinct_2", "distinct-2", cfg.min_distinct_ratio, None),
        ("length_mean", "mean length", cfg.min_length_ratio, cfg.max_length_ratio),
    )
    for name, said, low, high in ratios:
        if low is None and high is None:
            continue
        pair = _measured(metrics, name, said, out)
        if pair is None:
            continue
        base, cand = pair
        ratio = cand / base if base > 0 else (1.0 if cand == base else float("inf"))
        ok = (low is None or ratio >= low) and (high is None or ratio <= high)
        bounds = " and ".join(f"{sign} {limit}" for sign, limit in ((">=", low), ("<=", high)) if limit is not None)
        out.append(Check(ok, needs(f"degeneration: {said} ratio", bounds, f"{ratio:.3f}", _sides(base, cand))))
    return out


def refusal(lines: list[str], metrics: dict[str, float]) -> str:
    """The one line a person reads when the gate refuses: every failed check, and when a guard failed while
    the training reward rose, that this gain is not trusted."""
    failed = [line.removeprefix("FAIL: ") for line in lines if line.startswith("FAIL: ")]
    if not failed:
        return ""
    text = "gate refused: " + "; ".join(failed)
    gain = metrics.get("reward_gain")
    guarded = any(
        line.startswith(("capability:", "degeneration:", "held-out reward model:", "llm judge:", "suites:"))
        for line in failed
    )
    if guarded and gain is not None and gain > 0:
        text += f"; the training reward model's gain {gain:+.3f} is not trusted (reward hacking suspected)"
    return text


# Whose check a line is (its text's start), for min_judge_agreement: the training reward model's win-rate and gain,
# the held-out reward model's and the LLM judge's guards. Judges as feedback.agreement names them.
JUDGE_OF = {
    "win_rate:": "reward",
    "win_rate_lower_bound:": "reward",
    "reward_gain:": "reward",
    "candidate_reward_mean:": "reward",
    "held-out reward model:": "heldout",
    "llm judge:": "llm_judge",
}


def judge_of(text: str) -> str | None:
    """The judge whose check `text` is (JUDGE_OF), None for the checks no judge makes (KL, degeneration, ...)."""
    return next((judge for start, judge in JUDGE_OF.items() if text.startswith(start)), None)


def untrusted(metrics: dict[str, float], cfg: GuardsConfig) -> dict[str, str]:
    """{judge: why} of the judges whose agreement with people (metrics' agreement_<judge>, from the latest
    feedback run) is below min_judge_agreement; {} when it is off or nobody was asked."""
    bar = cfg.min_judge_agreement
    out = {}
    for judge in dict.fromkeys(JUDGE_OF.values()) if bar is not None else ():
        rate = metrics.get(f"agreement_{judge}")
        if rate is None or rate != rate or rate >= bar:  # not measured (NaN: it leaned on no decided task)
            continue
        n = metrics.get(f"agreement_{judge}_n")
        said = f" over {int(n)} tasks" if n is not None else ""
        out[judge] = f"agrees with people on {rate:.2f}{said}, below promote.guards.min_judge_agreement {bar}"
    return out


def distrust(found: list[Check], away: dict[str, str], people: bool = False) -> list[Check]:
    """`found` with each check of an untrusted judge (`away`: untrusted()) reported, not counted; and, when every
    check some judge made is of an untrusted one, a failed check saying the gate has no trusted judge, unless
    `people` judged too (the online judge's people's win-rate check, canary.min_human_win_rate: people are what the
    judges are measured against), which a passed line then says the gate leans on alone."""
    out, judged, kept = [], 0, 0
    for check in found:
        judge = judge_of(check.text)
        judged += judge is not None
        if judge in away:
            out.append(Check(check.ok, f"{check.text} [{judge} {away[judge]}]", trusted=False))
        else:
            kept += judge is not None
            out.append(check)
    if away and judged and not kept:
        said = "0; the gate leans on people's win-rate alone" if people else "0"
        out.append(Check(people, needs("trusted judges", ">= 1 (promote.guards.min_judge_agreement)", said)))
    return out
