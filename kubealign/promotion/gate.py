"""The promotion gate: a pure decision rule (like kubealign.selection.ranking) over an evaluation's metrics, the
configured thresholds and the champion's metrics. No registry access; under mutation testing.
"""

from __future__ import annotations

import math

from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError
from kubealign.promotion import guards

GATED_METRICS = ("win_rate", "reward_gain", "kl_to_baseline", "candidate_reward_mean")
OPTIONAL_METRICS = ("win_rate_lower_bound",)  # gated only when its threshold is set


def gate(
    metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None, people: bool = False
) -> tuple[bool, list[str]]:
    """(passed, one line per check) for an evaluation's metrics against the thresholds and the champion, and
    promote.guards' checks against the baseline (kubealign.promotion.guards: a guard whose figures the metrics
    lack is an "unchecked: " line; the promote stage requires them, the online judge has not all of them).
    people: people's own verdict is checked beside the gate (the online judge's canary.min_human_win_rate), so a
    gate whose every judge people distrust (promote.guards.min_judge_agreement) leans on it (guards.distrust).
    promote.metric win_rate: the win-rate checks and the champion's candidate_reward_mean; another metric
    (e.g. fn/<NAME>/candidate) replaces them: min_metric, the baseline's value, the champion's value."""
    checks = [] if cfg.metric != "win_rate" else win_rate_checks(metrics, cfg)
    checks.append(
        (
            metrics["reward_gain"] >= cfg.min_reward_gain,
            guards.needs("reward_gain", f">= {cfg.min_reward_gain}", f"{metrics['reward_gain']:.3f}"),
        )
    )
    if cfg.max_kl is not None:
        kl = metrics["kl_to_baseline"]
        checks.append((kl <= cfg.max_kl, guards.needs("kl_to_baseline", f"<= {cfg.max_kl}", f"{kl:.3f}")))
    if cfg.metric != "win_rate":
        checks += metric_checks(metrics, cfg, champion)
    elif champion is not None and cfg.require_beat_champion:
        ours, theirs = metrics["candidate_reward_mean"], champion["candidate_reward_mean"]
        needed = f"> {theirs:.3f} (the champion's)"
        checks.append((ours > theirs, guards.needs("candidate_reward_mean", needed, f"{ours:.3f}")))
    found = [guards.Check(ok, text) for ok, text in checks] + guards.checks(
        metrics, cfg.guards, cfg.min_win_rate, cfg.tie_credit
    )
    # a judge that disagrees with people (promote.guards.min_judge_agreement): its checks said, not counted
    found = guards.distrust(found, guards.untrusted(metrics, cfg.guards), people)
    passed = all(c.ok is not False for c in found if c.counted)
    return passed, [c.line for c in found]


def win_rate_checks(metrics: dict[str, float], cfg: PromoteConfig) -> list[tuple[bool, str]]:
    rate, said = guards.credited(metrics, "win_rate", "tie_rate", cfg.tie_credit)
    checks = [(rate >= cfg.min_win_rate, guards.needs("win_rate", f">= {cfg.min_win_rate}", f"{rate:.3f}", said))]
    if cfg.min_win_rate_lower_bound is not None:
        bound = metrics.get("win_rate_lower_bound")
        if bound is None:
            raise UserError("promote.min_win_rate_lower_bound is set but the evaluation has no win_rate_lower_bound")
        threshold = cfg.min_win_rate_lower_bound
        checks.append((bound >= threshold, guards.needs("win_rate_lower_bound", f">= {threshold}", f"{bound:.3f}")))
    return checks


def metric_checks(
    metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None
) -> list[tuple[bool, str]]:
    """promote.metric's checks: its threshold, the SFT baseline's value of an fn/<NAME>/candidate metric, and
    the champion's value (a champion registered without this metric is not compared: said so)."""
    name = cfg.metric
    if name not in metrics:
        have = ", ".join(sorted(m for m in metrics if m.startswith("fn/"))) or "no fn/ metrics"
        raise UserError(f"promote.metric {name}: the evaluation has no such metric ({have})")
    ours = metrics[name]
    checks = []
    if cfg.min_metric is not None:
        checks.append((ours >= cfg.min_metric, guards.needs(name, f">= {cfg.min_metric}", f"{ours:.3f}")))
    if name.endswith("/candidate") and name.removesuffix("/candidate") + "/baseline" in metrics:
        base = metrics[name.removesuffix("/candidate") + "/baseline"]
        checks.append((ours > base, guards.needs(name, f"> {base:.3f} (the baseline's)", f"{ours:.3f}")))
    if champion is not None and cfg.require_beat_champion:
        theirs = champion.get(name, float("nan"))
        if math.isnan(theirs):
            checks.append((True, f"{name}: the champion has none recorded, not compared"))
        else:
            checks.append((ours > theirs, guards.needs(name, f"> {theirs:.3f} (the champion's)", f"{ours:.3f}")))
    return checks
