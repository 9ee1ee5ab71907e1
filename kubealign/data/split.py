"""Split normalized rows into the three RLHF phases — pure functions of rows, ratios and a seed.

DeepSpeed-Chat's data_split "2,4,4" splits *rows*; a prompt with several responses can then land in
two phases (the reward model and PPO would see the same prompts). Here the unit is the unique prompt:

1. Group rows by prompt. Prompts with at least one preference row (rejected not None) are permuted
   once with the seed and cut at the cumulative ratio boundaries; SFT-only prompts join phase 1.
2. Inside each phase, `eval_fraction` of its prompts (at least one when the fraction > 0 and the phase
   has two or more prompts, never all of them) form the eval split.
3. Phase 2 keeps only preference rows; phase 3 keeps one row per prompt (the prompt is what PPO uses;
   a prompt-only row first, for its columns).
   Prompt-only rows (chosen None: {prompt, ...} with no response) go to phase 3 and nowhere else: their
   prompts join phase 3 after the cut; one whose prompt also has responses follows them, and is dropped
   (prompt_only_outside_phase3) when they land in phase 1 or 2.
4. Train splits are reweighted per source (DataSource.weight); eval splits never are.
5. Prompts in `to_reward` (those a `phase: reward` source has a pair for: people's choices) are cut as all others,
   then moved into phase 2 whatever phase the cut gave them, and into its train split (never eval or heldout; rule 7):
   the other prompts keep their phases, and each phase's eval split is drawn from what it then holds.
6. With `heldout_fraction` > 0, that share of phase 2's train prompts (seeded; at least one, never all)
   forms phase 2's "heldout" split instead: the pairs the held-out reward model trains on (an
   independent scorer, docs/guards.md). Disjoint from what the reward model the policy is optimized against sees, so an
   exploit of that model's blind spots is not an exploit of this one's. Reweighted like train.
7. With `people_fraction` > 0, the `to_reward` prompts whose seeded hash falls below it (never all of them) form
   phase 2's "people" split instead of training: people's own pairs (rows of `people_sources`), on which the reward
   task checks its new model against people (kubealign.stages.reward); another source's pairs on such a prompt are
   dropped (people_checked_prompt), so the model never trains on it. By hash, not by draw: a prompt kept out once
   stays out as the project grows, so each round's check holds the earlier rounds' and the new model never trained
   on any of it. Not reweighted (a check, like eval).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

PHASES = ("phase1_sft", "phase2_reward", "phase3_prompts")
SPLITS = ("train", "eval")
HELDOUT = "heldout"  # phase 2's third split (rule 6), present only when reserved
PEOPLE = "people"  # phase 2's split of people's pairs kept out of training (rule 7), present only when asked
Row = dict[str, Any]  # keys: prompt, chosen (None: prompt-only), rejected (str | None), columns, source, origin


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def phase_boundaries(n: int, ratios: Sequence[float]) -> tuple[int, int]:
    """Cut points of n permuted prompts: phase k gets [b_{k-1}, b_k). Each phase is within one prompt
    of n * r_k / sum(r), because the boundaries are rounded cumulative sums."""
    total = sum(ratios)
    b1 = round_half_up(n * ratios[0] / total)
    b2 = round_half_up(n * (ratios[0] + ratios[1]) / total)
    return b1, b2


def assign_prompts(
    preference_prompts: Sequence[str],
    sft_prompts: Sequence[str],
    ratios: Sequence[float],
    seed: int,
    prompt_only: Sequence[str] = (),
) -> list[list[str]]:
    """Prompts of each phase. preference_prompts are unique and in a fixed (first-seen) order."""
    order = list(preference_prompts)
    random.Random(seed).shuffle(order)
    b1, b2 = phase_boundaries(len(order), ratios)
    return [order[:b1] + list(sft_prompts), order[b1:b2], order[b2:] + list(prompt_only)]


def eval_count(n: int, fraction: float) -> int:
    """How many of a phase's n prompts go to eval."""
    if fraction <= 0 or n < 2:
        return 0
    return min(max(round_half_up(n * fraction), 1), n - 1)


def holdout(prompts: Sequence[str], fraction: float, rng: random.Random) -> set[str]:
    """A seeded random subset of the phase's prompts for the eval split."""
    return set(rng.sample(list(prompts), eval_count(len(prompts), fraction)))


def people_check(prompts: Sequence[str], fraction: float, seed: int) -> set[str]:
    """Rule 7: the prompts whose sha256 with the seed, read as a share of 2**64, is below `fraction`; never all of
    them (the one of highest hash trains then)."""
    if fraction <= 0:
        return set()
    share = {
        p: int.from_bytes(hashlib.sha256(f"{seed}-{PEOPLE}-{p}".encode()).digest()[:8], "big") / 2**64 for p in prompts
    }
    kept = {p for p, h in share.items() if h < fraction}
    if kept and len(kept) == len(share):
        kept.discard(max(share, key=share.__getitem__))
    return kept


def reweight(rows: list[Row], weights: Mapping[str, float], rng: random.Random) -> list[Row]:
    """Subsample (weight < 1) or repeat (weight > 1) each source's rows to round(weight * count)."""
    by_source: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_source.setdefault(row["source"], []).append(i)
    keep: list[int] = []
    extra: list[int] = []
    for source, indices in by_source.items():
        weight = weights.get(source, 1.0)
        whole, frac = int(weight), weight - int(weight)
        if weight < 1:
            keep += rng.sample(indices, round_half_up(len(indices) * weight))
            continue
        keep += indices
        extra += indices * (whole - 1) + rng.sample(indices, round_half_up(len(indices) * frac))
    return [rows[i] for i in sorted(keep)] + [rows[i] for i in extra]


class SplitPlan(NamedTuple):
    phases: dict[str, dict[str, list[Row]]]  # phase -> split -> rows
    prompts: dict[str, dict[str, int]]  # phase -> split -> unique prompts (before reweighting)
    dropped: list[tuple[str, Row]]  # (reason, row): rows that no phase can use


def split_rows(
    rows: Sequence[Row],
    ratios: Sequence[float],
    eval_fraction: float,
    seed: int,
    weights: Mapping[str, float] | None = None,
    heldout_fraction: float = 0.0,
    to_reward: frozenset[str] = frozenset(),
    people_fraction: float = 0.0,
    people_sources: frozenset[str] = frozenset(),
) -> SplitPlan:
    """Assign every row to a phase and split (see the module docstring for the rules)."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row["prompt"], []).append(row)
    preference = [p for p, g in groups.items() if any(r["rejected"] is not None for r in g)]
    sft_only = [
        p
        for p, g in groups.items()
        if all(r["rejected"] is None for r in g) and any(r["chosen"] is not None for r in g)
    ]
    only = [p for p, g in groups.items() if all(r["chosen"] is None for r in g)]
    phase_prompts = assign_prompts(preference, sft_only, ratios, seed, only)
    moved = [p for p in preference if p in to_reward]  # rule 5, in first-seen order
    phase_prompts = [[p for p in prompts if p not in to_reward] for prompts in phase_prompts]
    phase_prompts[1] += moved

    phases: dict[str, dict[str, list[Row]]] = {}
    counts: dict[str, dict[str, int]] = {}
    dropped: list[tuple[str, Row]] = []
    for k, (phase, prompts) in enumerate(zip(PHASES, phase_prompts, strict=True)):
        rng = random.Random(f"{seed}-{phase}")
        held = holdout([p for p in prompts if p not in to_reward], eval_fraction, rng)
        out: dict[str, list[Row]] = {"train": [], "eval": []}
        reserved: set[str] = set()
        checked = people_check([p for p in prompts if p in to_reward], people_fraction, seed) if k == 1 else set()
        if checked:
            out[PEOPLE] = []
        if k == 1 and heldout_fraction > 0:  # its own seed: the eval split stays what it was without it
            trained = [p for p in prompts if p not in held and p not in to_reward]
            reserved = holdout(trained, heldout_fraction, random.Random(f"{seed}-{phase}-{HELDOUT}"))
            out[HELDOUT] = []
        for prompt in prompts:
            group = groups[prompt]
            if k < 2:  # a prompt-only row has nothing to train on in SFT or the reward model
                dropped += [("prompt_only_outside_phase3", r) for r in group if r["chosen"] is None]
                group = [r for r in group if r["chosen"] is not None]
            if k == 1:  # the reward phase needs pairs
                dropped += [("unpaired_in_reward_phase", r) for r in group if r["rejected"] is None]
                group = [r for r in group if r["rejected"] is not None]
            elif k == 2:  # PPO needs each prompt once: a prompt-only row (its columns), else one with a pair
                paired = next((r for r in group if r["rejected"] is not None), group[0])
                group = [next((r for r in group if r["chosen"] is None), paired)]
            if prompt in checked:  # rule 7: people's own pairs check the model; no other pair on it trains it
                dropped += [("people_checked_prompt", r) for r in group if r["source"] not in people_sources]
                out[PEOPLE].extend(r for r in group if r["source"] in people_sources)
                continue
            out["eval" if prompt in held else HELDOUT if prompt in reserved else "train"].extend(group)
        counts[phase] = {"train": len(prompts) - len(held) - len(reserved) - len(checked), "eval": len(held)}
        if HELDOUT in out:
            counts[phase][HELDOUT] = len(reserved)
        if PEOPLE in out:
            counts[phase][PEOPLE] = len(checked)
        if weights and any(w != 1.0 for w in weights.values()):
            out["train"] = reweight(out["train"], weights, rng)
            if HELDOUT in out:
                out[HELDOUT] = reweight(out[HELDOUT], weights, rng)
        phases[phase] = out
    return SplitPlan(phases, counts, dropped)
