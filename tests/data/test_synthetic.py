"""The built-in synthetic preference data carries its documented property, deterministically."""

from __future__ import annotations

import pytest

from kubealign.data import synthetic
from kubealign.data.schemas import normalize
from kubealign.errors import UserError


def test_deterministic_by_seed():
    assert synthetic.generate(50, 10, seed=1) == synthetic.generate(50, 10, seed=1)
    assert synthetic.generate(50, 10, seed=1) != synthetic.generate(50, 10, seed=2)


def test_pairs_differ_only_in_the_opener():
    rows = synthetic.generate(1000, 0, seed=0)
    styles = []
    for row in rows:
        pair = normalize(row)
        chosen, rejected = synthetic.grade(pair.prompt, pair.chosen), synthetic.grade(pair.prompt, pair.rejected)
        assert chosen == synthetic.Grade(True, "courteous", True, True)
        assert not rejected.preferred
        assert synthetic.is_courteous(pair.chosen)
        fact = pair.chosen.split("! ", 1)[1] if "! " in pair.chosen else None
        assert fact is not None and pair.rejected.endswith(" " + fact)  # the same fact, another opener
        opener = pair.rejected.removesuffix(" " + fact).strip()
        if rejected.well_formed:
            assert rejected.on_topic and not synthetic.is_courteous(pair.rejected)
            styles.append(rejected.style)
        else:  # effusive: two different courteous openers
            first = next(o for o in synthetic.COURTEOUS if opener.startswith(o))
            second = opener.removeprefix(first).strip()
            assert second in synthetic.COURTEOUS and second != first
            styles.append("effusive")
    for style, expected in synthetic.REJECTED_STYLES.items():
        assert abs(styles.count(style) / len(styles) - expected) < 0.05, style


def test_demonstrations_are_well_formed_on_topic_and_of_mixed_quality():
    rows = synthetic.generate(0, 2000, seed=3)
    verdicts = [synthetic.grade(r["prompt"], r["response"]) for r in rows]
    assert all(v.well_formed and v.on_topic for v in verdicts)
    shares = {s: sum(v.style == s for v in verdicts) / len(rows) for s in synthetic.DEMO_STYLES}
    for style, expected in synthetic.DEMO_STYLES.items():
        assert abs(shares[style] - expected) < 0.04, (style, shares)
    assert sum(v.preferred for v in verdicts) / len(rows) == shares["courteous"]


PROMPT = synthetic.format_prompt("Tell me one fact about bees.")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" Happy to help! Bees make honey from nectar.", (True, "courteous", True, True)),
        ("Bees make honey from nectar.", (True, "plain", True, False)),
        (" Go look it up. Bees carry pollen from flower to flower.", (True, "dismissive", True, False)),
        (" Happy to help! Cats sleep for most of the day.", (True, "courteous", False, False)),  # off topic
        (" Happy to help! Bees make honey from nectar. Bees make honey from nectar.", (False, None, False, False)),
        (" Happy to help!Bees make honey from nectar.", (False, None, False, False)),  # no space after the opener
        (" Happy to help!", (False, None, False, False)),  # an opener alone
        (" Happy to help! Bees make honey from", (False, None, False, False)),  # cut short
        (" Of course! Happy to help! Bees make honey from nectar.", (False, None, False, False)),  # two openers
        ("", (False, None, False, False)),
    ],
)
def test_judge_parses_the_grammar(text, expected):
    assert tuple(synthetic.grade(PROMPT, text)) == expected


def test_prompt_topic_takes_the_named_topic_not_a_word_inside_another():
    assert synthetic.prompt_topic(synthetic.format_prompt("Teach me something about trains.")) == "trains"
    assert synthetic.prompt_topic(synthetic.format_prompt("Say something true about rain.")) == "rain"
    assert synthetic.prompt_topic(synthetic.format_prompt("Tell me about the sun.")) == "the sun"
    assert synthetic.prompt_topic(synthetic.format_prompt("Tell me about nothing.")) is None


def test_prompts_are_unique_and_sft_rows_are_prompt_response():
    rows = synthetic.generate(300, 100, seed=4)
    assert len({r["prompt"] for r in rows}) == 400
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in rows[:300])
    assert all(set(r) == {"prompt", "response"} for r in rows[300:])
    assert all(r["prompt"].startswith("\n\nHuman: ") and r["prompt"].endswith("\n\nAssistant:") for r in rows)


def test_capacity_is_enforced_with_the_field_names():
    with pytest.raises(UserError, match="data.synthetic_pairs"):
        synthetic.generate(synthetic.CAPACITY, 1, seed=0)
