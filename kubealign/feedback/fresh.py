"""The reward models checked against people on pairs they never trained on (data.people_check_fraction).

A judge's agreement read from the feedback runs (kubealign.feedback.lookup.agreement) is the record of the reward
models that scored the served pairs people decided: a round's newly trained reward model inherits it. When
data-split kept a share of people's pairs out of training (phase 2's "people" split), the reward task checks the new
model (and the held-out one beside it) on them and logs people_agreement with its interval (kubealign.stages.reward);
those figures are this model's own, so they take the place of the inherited agreement_reward / agreement_heldout
where the gate reads them (the online judge, evaluate's metrics for promote).
"""

from __future__ import annotations

import json
from pathlib import Path

from kubealign.data.split import HELDOUT

FIGURES = ("people_agreement", "people_agreement_low", "people_agreement_high", "people_agreement_n")


def figures(metrics: dict[str, float]) -> dict[str, float]:
    """agreement_reward (_low, _high, _n) from a reward run's after_people_agreement* (the trained model's: the
    training loop names its final evaluation after_*), agreement_heldout from its heldout/after_people_agreement*;
    nothing for a model checked on no pair."""
    out: dict[str, float] = {}
    for prefix, judge in (("after_", "reward"), (f"{HELDOUT}/after_", "heldout")):
        found = {name: metrics.get(prefix + name) for name in FIGURES}
        if any(value is None for value in found.values()) or not found["people_agreement_n"]:
            continue
        for name, value in found.items():
            out[name.replace("people_agreement", f"agreement_{judge}")] = float(value)
    return out


def of_reward_dir(reward: Path | None) -> dict[str, float]:
    """figures() of the reward model in `reward` (its result.json); {} without one, or one that has none."""
    if reward is None:
        return {}
    try:
        result = json.loads((Path(reward) / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    metrics = result.get("metrics") if isinstance(result, dict) else None
    return figures(metrics) if isinstance(metrics, dict) else {}
