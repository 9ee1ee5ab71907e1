"""What the loop checks and pools of an experience before it trains on it: a nan or inf in any value the
update reads (experience_fault, raised as NonFiniteExperience before any weight moves, naming what is not
finite and whether a trained model made it) and each reward function's mean over every rank's responses
(pooled_function_means, logged as fn/NAME). Each is one collective that every rank takes alike."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kubealign.rewards import totals
from kubealign.rl.experience import Experience
from kubealign.training import distributed
from kubealign.training.loop import NonFiniteLoss


class NonFiniteExperience(NonFiniteLoss):
    """The experience an update would train on holds a nan or inf (a reward score, a log-prob, a value):
    the cause of the non-finite loss it would give is known (see ExperienceFault)."""

    def __init__(self, fault: ExperienceFault):
        super().__init__(fault.message)
        self.trained = fault.trained


class ExperienceFault(NamedTuple):
    message: str  # what is not finite, and how often; '' when everything is
    trained: bool  # a model that trains (actor, critic) is among them: it diverged, its learning rate a suspect


def experience_fault(exp: Experience) -> ExperienceFault:
    """Which values the update reads are not finite, counted over every rank (one all_reduce, so every
    rank raises alike). Scores count per response; log-probs and values per response token (what lies
    outside the response is never read)."""
    fields = [
        ("the reward score", "responses", exp.scores, None, False),
        ("the actor's log-prob", "tokens", exp.logprobs, exp.response_mask, True),
        ("the reference's log-prob", "tokens", exp.ref_logprobs, exp.response_mask, False),
    ]
    if exp.values is not None:
        fields.append(("the critic's value", "tokens", exp.values, exp.response_mask, True))
    counts, examples = [], []
    for _, _, x, mask, _ in fields:
        where = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
        bad = ~torch.isfinite(x) & where
        counts += [float(bad.sum()), float(where.sum())]
        examples.append(float(x[bad][0]) if bool(bad.any()) else None)
    summed = distributed.all_reduce_sum(counts)
    faults, trained = [], False
    for (name, unit, _, _, trains), example, bad, total in zip(
        fields, examples, summed[::2], summed[1::2], strict=True
    ):
        if bad:
            value = f" ({example:g})" if example is not None else ""  # another rank's: no example here
            faults.append(f"{name} is not finite{value} for {int(bad)} of {int(total)} {unit}")
            trained = trained or trains
    return ExperienceFault("; ".join(faults), trained)


def pooled_function_means(exp: Experience) -> dict[str, float]:
    """fn/<NAME>: each reward function's mean over every rank's responses of this experience it applied to
    (None rows left out); a function that applied to none is not logged."""
    mine = totals.function_totals(exp.functions or {})
    if not mine:  # the same on every rank (one config): no collective is skipped on one rank only
        return {}
    flat = distributed.all_reduce_sum([x for total, count in mine.values() for x in (total, float(count))])
    return totals.function_means({name: (s, int(c)) for name, s, c in zip(mine, flat[::2], flat[1::2], strict=True)})
