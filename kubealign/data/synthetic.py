"""Built-in synthetic preference data: the data of the embedded default, where RLHF has real work to do.

The task mirrors how RLHF is used: demonstrations of mixed quality, preferences that single out the
good behaviour, and a policy that must learn to prefer it.

* A response is ``[OPENER ]FACT``: an optional opener phrase, then one fact sentence (FACTS). That is
  the whole grammar; `grade` parses a response against it, so well-formedness is measurable.
* The preferred behaviour is a courteous opener (COURTEOUS) followed by a fact about the topic the
  prompt asks about.
* **Demonstrations** (SFT-only rows, ``{prompt, response}``) are of mixed quality, like human-written
  SFT data: a fact about the asked topic, opened courteously in only DEMO_STYLES["courteous"] of them,
  dismissively (DISMISSIVE) or not at all in the others.
* **Preference pairs** (``{prompt, chosen, rejected}``) are minimal pairs: the same on-topic fact,
  chosen with one courteous opener, rejected with a dismissive one, none, or two courteous ones in a
  row (REJECTED_STYLES). The opener alone separates them, so a reward model learns exactly the
  preference and PPO has something SFT did not teach; the effusive pairs teach it that piling up
  courtesy is no better, which is the reward hack PPO otherwise finds first.

Prompts and responses follow the plain dialogue format of HH-RLHF: prompt =
"\\n\\nHuman: <question>\\n\\nAssistant:", response = " <text>". Everything is a pure function of the seed.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, NamedTuple

from kubealign.errors import UserError

FACTS: dict[str, tuple[str, str]] = {
    "the moon": ("The moon orbits the Earth about once a month.", "The moon has no air to breathe."),
    "the sun": ("The sun is a star at the center of our solar system.", "The sun gives the Earth light."),
    "the ocean": ("The ocean covers most of the Earth.", "The ocean is salty because of minerals."),
    "rain": ("Rain falls when water drops in clouds get heavy.", "Rain helps plants grow."),
    "snow": ("Snow forms when water freezes high in the clouds.", "Snow is made of small ice crystals."),
    "trees": ("Trees make oxygen from sunlight and water.", "Trees grow a new ring every year."),
    "bees": ("Bees carry pollen from flower to flower.", "Bees make honey from nectar."),
    "cats": ("Cats sleep for most of the day.", "Cats use their whiskers to feel the space around them."),
    "dogs": ("Dogs have a very strong sense of smell.", "Dogs were the first animals people kept."),
    "horses": ("Horses can sleep while standing up.", "Horses run on the tips of their hooves."),
    "whales": ("Whales breathe air through a hole on their back.", "Whales sing to talk to each other."),
    "owls": ("Owls can turn their heads very far around.", "Owls hunt at night with sharp hearing."),
    "bread": ("Bread rises because yeast makes gas.", "Bread is baked from flour and water."),
    "cheese": ("Cheese is made from milk.", "Some cheese is aged for years."),
    "apples": ("Apples grow on trees in cool places.", "Apples float because they hold air."),
    "rice": ("Rice grows in wet fields.", "Rice feeds more people than any other grain."),
    "coffee": ("Coffee is made from roasted beans.", "Coffee has caffeine that keeps people awake."),
    "tea": ("Tea is made from dried leaves.", "Tea has been drunk for thousands of years."),
    "music": ("Music is sound arranged in time.", "Music can change how people feel."),
    "the piano": ("The piano has eighty-eight keys.", "The piano makes sound with small hammers."),
    "chess": ("Chess is played on a board of sixty-four squares.", "Chess began in India long ago."),
    "soccer": ("Soccer is played by two teams of eleven.", "Soccer is the most watched sport."),
    "bicycles": ("Bicycles turn pedal power into motion.", "Bicycles need no fuel to ride."),
    "trains": ("Trains run on steel rails.", "Trains can carry heavy loads far."),
    "airplanes": ("Airplanes fly because their wings make lift.", "Airplanes cruise high above clouds."),
    "rockets": ("Rockets push hot gas out to move forward.", "Rockets can fly in empty space."),
    "computers": ("Computers store everything as ones and zeros.", "Computers follow exact instructions."),
    "the internet": ("The internet links computers around the world.", "The internet sends data in packets."),
    "books": ("Books were once copied by hand.", "Books keep ideas for a long time."),
    "maps": ("Maps show places from above.", "Maps use a scale to show distance."),
    "volcanoes": ("Volcanoes pour out melted rock.", "Volcanoes can build new islands."),
    "mountains": ("Mountains form when the ground is pushed up.", "Mountains are colder at the top."),
    "deserts": ("Deserts get very little rain.", "Deserts can be cold at night."),
    "rivers": ("Rivers flow downhill to the sea.", "Rivers carry sand and mud."),
    "gardens": ("Gardens need sun, water and soil.", "Gardens can feed birds and bees."),
    "clocks": ("Clocks measure the passing of time.", "Clocks once used swinging weights."),
}
QUESTIONS: tuple[str, ...] = (
    "What can you tell me about {t}?",
    "Tell me one fact about {t}.",
    "I am curious about {t}. What should I know?",
    "Can you explain something about {t}?",
    "Give me a short note on {t}.",
    "What is interesting about {t}?",
    "Teach me something about {t}.",
    "Share a fact about {t}, please.",
    "Do you know anything about {t}?",
    "Say something true about {t}.",
)
OPENERS: tuple[str, ...] = (
    "",
    "I am a student. ",
    "My friend asked me this. ",
    "Quick question. ",
    "For a school project: ",
    "Just wondering. ",
    "I have a test tomorrow. ",
    "Hello! ",
)
COURTEOUS: tuple[str, ...] = (
    "Happy to help!",
    "Great question!",
    "Sure, glad you asked!",
    "Of course!",
    "Thanks for asking!",
)
DISMISSIVE: tuple[str, ...] = (
    "Ugh, whatever.",
    "Figure it out yourself.",
    "Not my problem.",
    "Why would I care?",
    "Go look it up.",
)
# How demonstrations open: only a minority show the preferred (courteous) behaviour.
DEMO_STYLES: dict[str, float] = {"courteous": 0.15, "plain": 0.55, "dismissive": 0.3}
# How the rejected answer of a preference pair opens ("effusive": two courteous openers, not well formed).
REJECTED_STYLES: dict[str, float] = {"plain": 0.4, "dismissive": 0.4, "effusive": 0.2}
VERSION = 2  # bump when the generator's output changes; it is part of the data cache key
CAPACITY = len(FACTS) * len(QUESTIONS) * len(OPENERS)
_TOPIC_OF_FACT = {fact: topic for topic, facts in FACTS.items() for fact in facts}


def format_prompt(question: str) -> str:
    """The plain dialogue format shared with HH-RLHF."""
    return f"\n\nHuman: {question}\n\nAssistant:"


def _prompt_space() -> list[tuple[str, str]]:
    """All (topic, question) combinations, in a fixed order."""
    topics = list(FACTS)
    return [
        (topic, opener + template.format(t=topic))
        for topic, template, opener in itertools.product(topics, QUESTIONS, OPENERS)
    ]


def response(rng: random.Random, fact: str, style: str) -> str:
    """A response stating `fact`, opening in `style`: courteous, plain or dismissive (well formed), or
    effusive (two different courteous openers: the over-the-top answer preference data rejects)."""
    if style == "plain":
        return f" {fact}"
    if style == "effusive":
        return f" {' '.join(rng.sample(COURTEOUS, 2))} {fact}"
    return f" {rng.choice(COURTEOUS if style == 'courteous' else DISMISSIVE)} {fact}"


def demonstration(rng: random.Random, topic: str) -> str:
    """An SFT demonstration: a fact on topic, opened in a style drawn from DEMO_STYLES."""
    style = rng.choices(list(DEMO_STYLES), weights=list(DEMO_STYLES.values()))[0]
    return response(rng, rng.choice(FACTS[topic]), style)


def preference_pair(rng: random.Random, topic: str) -> tuple[str, str]:
    """(chosen, rejected): one on-topic fact, opened with one courteous phrase vs. REJECTED_STYLES."""
    fact = rng.choice(FACTS[topic])
    style = rng.choices(list(REJECTED_STYLES), weights=list(REJECTED_STYLES.values()))[0]
    return response(rng, fact, "courteous"), response(rng, fact, style)


def generate(pairs: int, sft_rows: int, seed: int) -> list[dict[str, Any]]:
    """`pairs` preference rows {prompt, chosen, rejected} then `sft_rows` demonstrations {prompt, response}.

    Every row has its own prompt (sampled without replacement from CAPACITY combinations).
    """
    if pairs + sft_rows > CAPACITY:
        raise UserError(
            f"data.synthetic_pairs + data.synthetic_sft_rows = {pairs + sft_rows} exceeds the "
            f"{CAPACITY} distinct synthetic prompts"
        )
    rng = random.Random(f"kubealign-synthetic-{seed}")
    chosen_prompts = rng.sample(_prompt_space(), pairs + sft_rows)
    rows: list[dict[str, Any]] = []
    for topic, question in chosen_prompts[:pairs]:
        chosen, rejected = preference_pair(rng, topic)
        rows.append({"prompt": format_prompt(question), "chosen": chosen, "rejected": rejected})
    for topic, question in chosen_prompts[pairs:]:
        rows.append({"prompt": format_prompt(question), "response": demonstration(rng, topic)})
    return rows


class Grade(NamedTuple):
    """What the grammar says of one response to one prompt."""

    well_formed: bool  # exactly [OPENER ]FACT
    style: str | None  # courteous / plain / dismissive; None when not well formed
    on_topic: bool  # the fact is about the topic the prompt asks about
    preferred: bool  # well formed, courteous and on topic


def prompt_topic(prompt: str) -> str | None:
    """The topic a synthetic prompt asks about (the longest topic named in its question)."""
    question = prompt.rsplit("Human:", 1)[-1]
    named = [t for t in FACTS if f" {t}" in question]
    return max(named, key=len) if named else None


def grade(prompt: str, text: str) -> Grade:
    """Parse a response against the generator's grammar: ``[OPENER ]FACT``, nothing before or after."""
    body = text.strip()
    style = "plain"
    for name, openers in (("courteous", COURTEOUS), ("dismissive", DISMISSIVE)):
        opener = next((o for o in openers if body.startswith(o + " ")), None)
        if opener is not None:
            style, body = name, body[len(opener) + 1 :]
            break
    topic = _TOPIC_OF_FACT.get(body)
    if topic is None:
        return Grade(False, None, False, False)
    on_topic = topic == prompt_topic(prompt)
    return Grade(True, style, on_topic, style == "courteous" and on_topic)


def is_courteous(response: str) -> bool:
    """The documented preference property: does the response open with a courteous phrase?"""
    return response.strip().startswith(COURTEOUS)


def corpus(seed: int = 0) -> list[str]:
    """Text the tiny models' tokenizer is trained on: every phrase the generator can emit."""
    texts = [format_prompt(q) for _, q in _prompt_space()]
    facts = [f for pair in FACTS.values() for f in pair]
    texts += [f" {o} {f}" for o in COURTEOUS + DISMISSIVE for f in facts] + [f" {f}" for f in facts]
    random.Random(seed).shuffle(texts)
    return texts
