"""A new reward model checked against people on pairs it never trained on (data.people_check_fraction): data-split
keeps a share of a `phase: reward` source's prompts out of training, the reward task scores people's pairs on them
with the model it trained (and the held-out one), and the gate reads those figures in place of the agreement the
model would otherwise inherit from earlier rounds (kubealign.feedback.fresh). Real data-split and reward stages on
the tiny preset; the agreement recomputed here from the exported model's own scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kubealign.feedback import fresh
from kubealign.feedback.annotations import wilson
from tests.conftest import NO_TRACKING

pytestmark = pytest.mark.integration
FACTS = ["owls hunt at night", "bees make honey", "the moon orbits the earth", "ice floats on water"]


def people_file(path: Path, n: int = 40) -> Path:
    """n of people's choices in the synthetic task's style; every third one prefers the curt answer (people are
    not the synthetic preference), so the model cannot agree with all of them."""
    rows = []
    for i in range(n):
        prompt = f"\n\nHuman: Tell me one fact, number {i}, about the world.\n\nAssistant:"
        fact = FACTS[i % len(FACTS)].capitalize() + "."
        kind, curt = f" Of course! {fact}", f" Go look it up. {fact}"
        chosen, rejected = (curt, kind) if i % 3 == 0 else (kind, curt)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def agreed_by(model_dir: Path, rows) -> int:
    """How many of the rows the exported model scores chosen above rejected, tokenized as the reward task does."""
    from transformers import AutoModelForSequenceClassification

    from kubealign.config import load_config
    from kubealign.data.tokenize import encode_preference, pad_batch
    from kubealign.models import loading
    from kubealign.models.value_head import last_token_scores, token_values

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = loading.load_tokenizer(str(model_dir))
    agreed, cap = 0, load_config(None, []).reward.max_seq_len
    for row in rows:
        pair = encode_preference(tokenizer, row["prompt"], row["chosen"], row["rejected"], cap)
        ids, mask = (torch.tensor(x) for x in pad_batch([pair[0].input_ids, pair[1].input_ids], tokenizer.pad_token_id))
        with torch.no_grad():
            chosen, rejected = last_token_scores(token_values(model, ids, mask), mask).tolist()
        agreed += chosen > rejected
    return agreed


def test_the_reward_task_checks_its_model_on_people_s_kept_out_pairs(cli, tmp_path: Path) -> None:
    import datasets

    people = people_file(tmp_path / "people.jsonl")
    sources = f"data.sources=[{{path: synthetic}}, {{path: {people}, phase: reward}}]"
    sets = ["--set", NO_TRACKING, "--set", sources, "--set", "data.people_check_fraction=0.3"]
    done = cli("data-split", *sets, "--output", tmp_path / "split")
    assert done.code == 0, done.err
    phase2 = datasets.load_from_disk(str(tmp_path / "split" / "phase2_reward"))
    checked = phase2["people"]
    assert 0 < len(checked) < 40 and set(checked["source"]) == {str(people)}
    assert not set(checked["prompt"]) & (set(phase2["train"]["prompt"]) | set(phase2["heldout"]["prompt"]))
    done = cli("reward", "--data", tmp_path / "split", "--set", NO_TRACKING, "--output", tmp_path / "rm")
    assert done.code == 0, done.err
    metrics = json.loads((tmp_path / "rm" / "result.json").read_text())["metrics"]
    n = len(checked)
    agreed = agreed_by(tmp_path / "rm", checked)
    assert 0 < agreed < n  # people who sometimes prefer the curt answer: the count tells
    assert metrics["after_people_agreement_n"] == n and metrics["after_people_agreement"] == agreed / n
    low, high = wilson(agreed, n)
    assert math.isclose(metrics["after_people_agreement_low"], low) and math.isclose(
        metrics["after_people_agreement_high"], high
    )
    # the held-out reward model is checked on the same pairs (it never trains on a `phase: reward` source's)
    held = agreed_by(tmp_path / "rm" / "heldout", checked)
    assert metrics["heldout/after_people_agreement"] == held / n and metrics["heldout/after_people_agreement_n"] == n
    # what the gate reads in place of the inherited record
    assert fresh.of_reward_dir(tmp_path / "rm") == {
        "agreement_reward": agreed / n,
        "agreement_reward_low": metrics["after_people_agreement_low"],
        "agreement_reward_high": metrics["after_people_agreement_high"],
        "agreement_reward_n": float(n),
        "agreement_heldout": held / n,
        "agreement_heldout_low": metrics["heldout/after_people_agreement_low"],
        "agreement_heldout_high": metrics["heldout/after_people_agreement_high"],
        "agreement_heldout_n": float(n),
    }


@pytest.mark.unit
def test_only_a_whole_check_on_some_pair_takes_the_inherited_record_s_place(tmp_path: Path) -> None:
    whole = {"after_people_agreement": 0.75, "after_people_agreement_low": 0.4, "after_people_agreement_high": 0.9}
    assert fresh.figures({**whole, "after_people_agreement_n": 8.0, "before_people_agreement": 0.5}) == {
        "agreement_reward": 0.75,
        "agreement_reward_low": 0.4,
        "agreement_reward_high": 0.9,
        "agreement_reward_n": 8.0,
    }
    assert fresh.figures({**whole, "after_people_agreement_n": 0.0}) == {}  # checked on no pair
    assert fresh.figures(whole) == {}  # a figure missing
    assert fresh.figures({"after_people_agreement": 0.75, "after_people_agreement_n": 8.0}) == {}  # no interval
    assert fresh.figures({f"heldout/{k}": v for k, v in {**whole, "after_people_agreement_n": 4.0}.items()}) == {
        "agreement_heldout": 0.75,
        "agreement_heldout_low": 0.4,
        "agreement_heldout_high": 0.9,
        "agreement_heldout_n": 4.0,
    }
    assert fresh.of_reward_dir(None) == {} and fresh.of_reward_dir(tmp_path) == {}  # no result.json
    (tmp_path / "result.json").write_text('{"metrics": [1]}', encoding="utf-8")
    assert fresh.of_reward_dir(tmp_path) == {}
