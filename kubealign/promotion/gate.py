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


def gate(metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None) -> tuple[bool, list[str]]:
    """(passed, one line per check) for an evaluation's metrics against the thresholds and the champion, and
    promote.guards' checks against the baseline (kubealign.promotion.guards: a guard whose figures the metrics
    lack is an "unchecked: " line; the promote stage requires them, the online judge has not all of them).
    promote.metric win_rate: the win-rate checks and the champion's candidate_reward_mean; another metric
    (e.g. fn/<NAME>/candidate) replaces them: min_metric, the baseline's value, the champion's value."""
    checks = [] if cfg.metric != "win_rate" else win_rate_checks(metrics, cfg)
    checks.append(
        (
            metrics["reward_gain"] >= cfg.min_reward_gain,
            f"reward_gain {metrics['reward_gain']:.3f} >= {cfg.min_reward_gain}",
        )
    )
    if cfg.max_kl is not None:
        kl = metrics["kl_to_baseline"]
        checks.append((kl <= cfg.max_kl, f"kl_to_baseline {kl:.3f} <= {cfg.max_kl}"))
    if cfg.metric != "win_rate":
        checks += metric_checks(metrics, cfg, champion)
    elif champion is not None and cfg.require_beat_champion:
        ours, theirs = metrics["candidate_reward_mean"], champion["candidate_reward_mean"]
        checks.append((ours > theirs, f"candidate_reward_mean {ours:.3f} > champion's {theirs:.3f}"))
    lines = [("pass: " if ok else "FAIL: ") + text for ok, text in checks]
    guarded = guards.checks(metrics, cfg.guards, cfg.min_win_rate)
    passed = all(ok for ok, _ in checks) and all(g.ok is not False for g in guarded)
    return passed, [*lines, *(g.line for g in guarded)]


def win_rate_checks(metrics: dict[str, float], cfg: PromoteConfig) -> list[tuple[bool, str]]:
    checks = [(metrics["win_rate"] >= cfg.min_win_rate, f"win_rate {metrics['win_rate']:.3f} >= {cfg.min_win_rate}")]
    if cfg.min_win_rate_lower_bound is not None:
        bound = metrics.get("win_rate_lower_bound")
        if bound is None:
            raise UserError("promote.min_win_rate_lower_bound is set but the evaluation has no win_rate_lower_bound")
        threshold = cfg.min_win_rate_lower_bound
        checks.append((bound >= threshold, f"win_rate_lower_bound {bound:.3f} >= {threshold}"))
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
        checks.append((ours >= cfg.min_metric, f"{name} {ours:.3f} >= {cfg.min_metric}"))
    if name.endswith("/candidate") and name.removesuffix("/candidate") + "/baseline" in metrics:
        base = metrics[name.removesuffix("/candidate") + "/baseline"]
        checks.append((ours > base, f"{name} {ours:.3f} > the baseline's {base:.3f}"))
    if champion is not None and cfg.require_beat_champion:
        theirs = champion.get(name, float("nan"))
        if math.isnan(theirs):
            checks.append((True, f"{name}: the champion has none recorded, not compared"))
        else:
            checks.append((ours > theirs, f"{name} {ours:.3f} > champion's {theirs:.3f}"))
    return checks
