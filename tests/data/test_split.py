"""The phase split: boundaries by hand, disjoint prompts, eval hold-out, reweighting, determinism."""

from __future__ import annotations

import random

import pytest

from kubealign.data.split import PHASES, eval_count, phase_boundaries, reweight, split_rows


def rows_for(n_pref: int, n_sft: int = 0, source: str = "s") -> list[dict]:
    rows = [
        {"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}", "source": source, "origin": f"f:{i}"}
        for i in range(n_pref)
    ]
    rows += [
        {"prompt": f"s{i}", "chosen": f"c{i}", "rejected": None, "source": source, "origin": f"g:{i}"}
        for i in range(n_sft)
    ]
    return rows


@pytest.mark.parametrize(
    ("n", "ratios", "expected"),
    [
        (10, (2, 4, 4), (2, 6)),
        (2301, (2, 4, 4), (460, 1381)),  # 460.2 -> 460, 1380.6 -> 1381: phases 460/921/920
        (7, (1, 1, 1), (2, 5)),  # 2.33 -> 2, 4.67 -> 5
        (5, (1, 0, 0), (5, 5)),
        (3, (0, 0, 1), (0, 0)),
    ],
)
def test_phase_boundaries_by_hand(n, ratios, expected):
    assert phase_boundaries(n, ratios) == expected


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [(10, 0.1, 1), (100, 0.1, 10), (3, 0.1, 1), (1, 0.5, 0), (2, 0.9, 1), (10, 0.0, 0)],
)
def test_eval_count(n, fraction, expected):
    assert eval_count(n, fraction) == expected


def test_prompts_are_disjoint_and_sizes_follow_ratios():
    rows = rows_for(1000, n_sft=50)
    plan = split_rows(rows, (2, 4, 4), 0.1, seed=3)
    seen: dict[str, str] = {}
    for phase in PHASES:
        for split in ("train", "eval"):
            for row in plan.phases[phase][split]:
                assert seen.setdefault(row["prompt"], phase) == phase, f"{row['prompt']} in two phases"
    pref_counts = [sum(1 for p, ph in seen.items() if ph == phase and p.startswith("p")) for phase in PHASES]
    assert pref_counts == [200, 400, 400]
    sft_phases = {ph for p, ph in seen.items() if p.startswith("s")}
    assert sft_phases == {"phase1_sft"}  # SFT-only rows feed phase 1 only
    assert plan.prompts["phase1_sft"] == {"train": 225, "eval": 25}
    assert plan.prompts["phase2_reward"] == {"train": 360, "eval": 40}


def test_same_seed_same_split_other_seed_other_split():
    rows = rows_for(200)
    a = split_rows(rows, (2, 4, 4), 0.1, seed=1)
    b = split_rows(list(rows), (2, 4, 4), 0.1, seed=1)
    c = split_rows(rows, (2, 4, 4), 0.1, seed=2)
    assert a.phases == b.phases
    assert a.phases["phase1_sft"]["train"] != c.phases["phase1_sft"]["train"]


def test_reward_phase_drops_unpaired_rows_and_ppo_phase_keeps_one_row_per_prompt():
    rows = rows_for(30)
    extra_sft = {"prompt": "p0", "chosen": "x", "rejected": None, "source": "s", "origin": "h:1"}
    second = {"prompt": "p0", "chosen": "y", "rejected": "z", "source": "s", "origin": "h:2"}
    plan = split_rows([*rows, extra_sft, second], (0, 1, 0), 0.0, seed=0)
    phase2 = plan.phases["phase2_reward"]["train"]
    assert len(phase2) == 31 and all(r["rejected"] is not None for r in phase2)
    assert [(reason, row["origin"]) for reason, row in plan.dropped] == [("unpaired_in_reward_phase", "h:1")]
    plan3 = split_rows([*rows, extra_sft, second], (0, 0, 1), 0.0, seed=0)
    phase3 = plan3.phases["phase3_prompts"]["train"]
    assert len(phase3) == 30 and len({r["prompt"] for r in phase3}) == 30
    assert next(r for r in phase3 if r["prompt"] == "p0")["origin"] == "f:0"


def test_reweight_subsamples_and_repeats_by_source():
    rows = rows_for(10, source="a") + rows_for(10, source="b")
    out = reweight(rows, {"a": 0.5, "b": 2.5}, random.Random(0))
    by_source = [r["source"] for r in out]
    assert by_source.count("a") == 5
    assert by_source.count("b") == 25
    assert {r["prompt"] for r in out if r["source"] == "b"} == {f"p{i}" for i in range(10)}


def test_weights_touch_train_splits_only():
    rows = rows_for(100)
    plain = split_rows(rows, (1, 1, 1), 0.2, seed=5)
    heavy = split_rows(rows, (1, 1, 1), 0.2, seed=5, weights={"s": 2.0})
    for phase in PHASES:
        assert heavy.phases[phase]["eval"] == plain.phases[phase]["eval"]
        assert len(heavy.phases[phase]["train"]) == 2 * len(plain.phases[phase]["train"])


def test_a_prompt_with_a_pair_and_a_prompt_only_row_follows_its_pair_and_keeps_its_columns_in_phase_3():
    """Six prompts, each with a preference pair, an SFT row and a prompt-only row (its columns), in three
    row orders: the prompt lands where its pair's draw puts it. Phase 1 keeps the two responses' rows and
    drops the prompt-only one, phase 2 keeps the pair alone, phase 3 keeps the prompt-only row (the columns
    reward functions need), whatever the order of the rows."""

    def row(prompt, chosen, rejected, origin, columns=None):
        return {
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "columns": columns,
            "source": "s",
            "origin": origin,
        }

    rows = []
    for i in range(6):
        group = [
            row(f"m{i}", "c", "r", f"pair:{i}"),
            row(f"m{i}", "d", None, f"sft:{i}"),
            row(f"m{i}", None, None, f"only:{i}", f'{{"answer": "{i}"}}'),
        ]
        rows += group[i % 3 :] + group[: i % 3]  # the prompt-only row first, last, in the middle
    plan = split_rows(rows, (1, 1, 1), 0.0, seed=5)
    kept = {ph: sorted(r["origin"] for r in plan.phases[ph]["train"]) for ph in PHASES}
    phase_of = {r["prompt"]: ph for ph in PHASES for r in plan.phases[ph]["train"]}
    assert sorted(phase_of.values()) == sorted(PHASES * 2)  # two prompts in each phase
    dropped = sorted((reason, r["origin"]) for reason, r in plan.dropped)
    expected_kept, expected_dropped = {ph: [] for ph in PHASES}, []
    for i in range(6):
        phase = phase_of[f"m{i}"]
        if phase == "phase1_sft":
            expected_kept[phase] += [f"pair:{i}", f"sft:{i}"]
            expected_dropped.append(("prompt_only_outside_phase3", f"only:{i}"))
        elif phase == "phase2_reward":
            expected_kept[phase].append(f"pair:{i}")
            expected_dropped += [("prompt_only_outside_phase3", f"only:{i}"), ("unpaired_in_reward_phase", f"sft:{i}")]
        else:
            expected_kept[phase].append(f"only:{i}")
    assert kept == {ph: sorted(v) for ph, v in expected_kept.items()}
    assert dropped == sorted(expected_dropped)
    assert {r["columns"] for r in plan.phases["phase3_prompts"]["train"]} == {
        f'{{"answer": "{p[1:]}"}}' for p, ph in phase_of.items() if ph == "phase3_prompts"
    }


def test_a_source_without_a_weight_keeps_weight_one_and_eval_rows_are_the_held_prompts():
    rows = rows_for(6, source="a") + rows_for(4, source="b")
    for r in rows[6:]:
        r["prompt"] = "b-" + r["prompt"]
    out = reweight(rows, {"a": 2.0}, random.Random(0))  # b has no weight: 1, kept as it is
    assert sorted(r["prompt"] for r in out if r["source"] == "b") == sorted(r["prompt"] for r in rows[6:])
    assert len([r for r in out if r["source"] == "a"]) == 12
    one_and_a_half = reweight(rows, {"a": 1.5}, random.Random(0))  # every row once, half of them twice
    assert len([r for r in one_and_a_half if r["source"] == "a"]) == 9
    both_halved = reweight(rows, {"a": 0.5, "b": 0.5}, random.Random(0))
    assert (
        len([r for r in both_halved if r["source"] == "a"]),
        len([r for r in both_halved if r["source"] == "b"]),
    ) == (3, 2)
    plan = split_rows(rows_for(20), (0, 0, 1), 0.25, seed=1)
    phase3 = plan.phases["phase3_prompts"]
    assert (len(phase3["train"]), len(phase3["eval"])) == (15, 5) == (plan.prompts["phase3_prompts"]["train"], 5)


def test_a_heldout_share_of_phase_2_is_reserved_disjoint_and_the_rest_is_unchanged():
    """data.heldout_reward_fraction: 0.25 of phase 2's 360 train prompts (90) become its heldout split, drawn
    with their own seed: eval and the other phases are what they were without it, and no pair is in two
    splits."""
    rows = rows_for(1000, n_sft=50)
    before = split_rows(rows, (2, 4, 4), 0.1, seed=3)
    plan = split_rows(rows, (2, 4, 4), 0.1, seed=3, heldout_fraction=0.25)
    assert plan.prompts["phase2_reward"] == {"train": 270, "eval": 40, "heldout": 90}
    reward, was = plan.phases["phase2_reward"], before.phases["phase2_reward"]
    assert reward["eval"] == was["eval"]
    assert {p: plan.phases[p] for p in ("phase1_sft", "phase3_prompts")} == {
        p: before.phases[p] for p in ("phase1_sft", "phase3_prompts")
    }
    train, held = {r["prompt"] for r in reward["train"]}, {r["prompt"] for r in reward["heldout"]}
    assert not train & held and train | held == {r["prompt"] for r in was["train"]}
    assert "heldout" not in before.phases["phase2_reward"]  # 0: no third split at all (phase 2 hashes as before)
    # at least one prompt when the fraction is above 0, never all; one prompt cannot be split
    tiny = split_rows(rows_for(30), (0, 1, 0), 0.0, seed=3, heldout_fraction=0.001)
    assert tiny.prompts["phase2_reward"] == {"train": 29, "eval": 0, "heldout": 1}
    most = split_rows(rows_for(30), (0, 1, 0), 0.0, seed=3, heldout_fraction=0.999)
    assert most.prompts["phase2_reward"] == {"train": 1, "eval": 0, "heldout": 29}
    # a weighted source is reweighted in heldout as in train (2.0: every pair twice)
    double = split_rows(rows_for(40), (0, 1, 0), 0.0, seed=3, weights={"s": 2.0}, heldout_fraction=0.25)
    assert len(double.phases["phase2_reward"]["heldout"]) == 2 * 10


def test_prompts_people_chose_on_train_the_reward_model_wherever_the_cut_put_them():
    """Rule 5: people's pairs (source "people") on 6 prompts the cut put in phase 3 (2 of them in its eval split, the
    online judge's prompts) and phase 1 move, with their synthetic pairs, into phase 2's train split; no other prompt
    changes phase; each eval split is drawn from what its phase then holds."""
    rows = rows_for(200)
    before = split_rows(rows, (2, 4, 4), 0.1, seed=3)
    phase_of = {r["prompt"]: ph for ph in PHASES for s in ("train", "eval") for r in before.phases[ph][s]}
    held3 = [r["prompt"] for r in before.phases["phase3_prompts"]["eval"]][:2]
    trained3 = [r["prompt"] for r in before.phases["phase3_prompts"]["train"]][:3]
    sft = [r["prompt"] for r in before.phases["phase1_sft"]["train"]][:1]
    chosen = [*held3, *trained3, *sft]
    people = [
        {"prompt": p, "chosen": f"yes{p}", "rejected": f"no{p}", "source": "people", "origin": f"h:{i}"}
        for i, p in enumerate(chosen)
    ]
    plan = split_rows([*rows, *people], (2, 4, 4), 0.1, seed=3, heldout_fraction=0.25, to_reward=frozenset(chosen))
    reward = plan.phases["phase2_reward"]
    train = [r for r in reward["train"] if r["prompt"] in chosen]
    assert sorted((r["prompt"], r["source"]) for r in train) == sorted(
        [(p, "s") for p in chosen] + [(p, "people") for p in chosen]
    )
    not_trained = [*reward["eval"], *reward["heldout"], *plan.phases["phase3_prompts"]["eval"]]
    assert not {r["prompt"] for r in not_trained} & set(chosen)
    after = {r["prompt"]: ph for ph in PHASES for s in plan.phases[ph] for r in plan.phases[ph][s]}
    assert {p: ph for p, ph in after.items() if p not in chosen} == {
        p: ph for p, ph in phase_of.items() if p not in chosen
    }
    # counts: phase 3 lost 5 prompts, phase 1 one, phase 2 gained 6 train prompts (its eval drawn as before: 8)
    assert plan.prompts["phase3_prompts"]["train"] + plan.prompts["phase3_prompts"]["eval"] == 80 - 5
    assert plan.prompts["phase2_reward"]["eval"] == before.prompts["phase2_reward"]["eval"] == 8
    assert plan.prompts["phase1_sft"]["train"] + plan.prompts["phase1_sft"]["eval"] == 40 - 1
    # without the set, people's pairs on phase 3 prompts are dropped there (one row per prompt: the first pair)
    plain = split_rows([*rows, *people], (2, 4, 4), 0.1, seed=3)
    assert not [r for ph in PHASES for s in ("train", "eval") for r in plain.phases[ph][s] if r["source"] == "people"
                and phase_of[r["prompt"]] == "phase3_prompts"]  # fmt: skip


def test_people_s_checked_pairs_never_train_and_stay_checked_as_the_project_grows():
    """Rule 7: of 30 prompts people chose on (each also has a synthetic pair), those whose seeded sha256 share is below
    0.3 hold people's pairs in phase 2's "people" split, their synthetic pairs dropped; the rest train. A project
    grown to 45 prompts keeps every one of the first check's prompts in its check."""
    import hashlib

    from kubealign.data.split import PEOPLE, people_check

    def share(prompt: str) -> float:  # the rule as documented: sha256 of "SEED-people-PROMPT", 8 bytes of 2**64
        return int.from_bytes(hashlib.sha256(f"3-people-{prompt}".encode()).digest()[:8], "big") / 2**64

    rows = rows_for(200)
    chosen = [f"p{i}" for i in range(30)]
    people = [{"prompt": p, "chosen": f"yes{p}", "rejected": f"no{p}", "source": "people", "origin": f"h:{i}"}
              for i, p in enumerate(chosen)]  # fmt: skip
    plan = split_rows([*rows, *people], (2, 4, 4), 0.1, 3, None, 0.25, frozenset(chosen), 0.3, frozenset({"people"}))
    reward = plan.phases["phase2_reward"]
    expected = {p for p in chosen if share(p) < 0.3}
    assert 0 < len(expected) < 30 and [r["prompt"] for r in reward[PEOPLE]] == [p for p in chosen if p in expected]
    assert {r["source"] for r in reward[PEOPLE]} == {"people"} and plan.prompts["phase2_reward"][PEOPLE] == len(
        expected
    )
    trained = {r["prompt"] for split in ("train", "eval", "heldout") for r in reward[split]}
    assert not trained & expected and set(chosen) - expected <= trained
    assert sorted(row["origin"] for reason, row in plan.dropped if reason == "people_checked_prompt") == sorted(
        f"f:{p[1:]}" for p in expected
    )
    assert plan.prompts["phase2_reward"]["train"] == len({r["prompt"] for r in reward["train"]})
    grown = [f"p{i}" for i in range(45)]
    assert expected <= people_check(grown, 0.3, 3) and people_check(chosen, 0.3, 3) == expected
    assert people_check(chosen, 0.0, 3) == set()
    # never all: with the bar above every share, the prompt of the highest share trains
    assert people_check(chosen, 1.0, 3) == set(chosen) - {max(chosen, key=share)}
    assert (
        PEOPLE
        not in split_rows([*rows, *people], (2, 4, 4), 0.1, 3, None, 0.25, frozenset(chosen)).phases["phase2_reward"]
    )
