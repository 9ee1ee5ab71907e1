"""Per-function means of reward-function values, the one place they are computed (the scorer's callers:
ppo's iterations and its evaluation, evaluate's baseline and candidate). A value None ("does not apply to
this response") is left out of its function's mean; a function that applied to nothing gets no metric.
Pure Python: no torch."""

from __future__ import annotations

Totals = dict[str, tuple[float, int]]  # function name -> (sum, count) of its values that are not None


def function_totals(per_function: dict[str, list[float | None]], into: Totals | None = None) -> Totals:
    """Each function's (sum, count) over the values that are not None, added to INTO's (a new dict)."""
    totals = dict(into or {})
    for name, values in per_function.items():
        total, count = totals.get(name, (0.0, 0))
        present = [v for v in values if v is not None]
        totals[name] = (total + sum(present), count + len(present))
    return totals


def function_means(totals: Totals, suffix: str = "") -> dict[str, float]:
    """fn/<NAME><suffix>: each function's mean over the responses it applied to; none applied: no metric."""
    return {f"fn/{name}{suffix}": total / count for name, (total, count) in totals.items() if count}
