"""The rows of the `kubealign_facts` lm-eval task (kubealign_facts.yaml beside this file loads them with
`custom_dataset: !function facts.load`): one multiple-choice question per fact of the built-in synthetic data
(kubealign.data.synthetic), asked as the embedded data asks, with that fact and the same-numbered facts of the
next three topics as choices. The right choice is placed by a rotation, so a model that prefers one slot
scores a quarter. A model that still knows the facts SFT taught picks the right one; RL that wrecked its
language modelling does not."""

from __future__ import annotations

from typing import Any

from kubealign.data import synthetic

CHOICES = 4


def rows() -> list[dict[str, Any]]:
    """Every question, in a fixed order: {question, choices, answer (the right choice's index)}."""
    topics = list(synthetic.FACTS)
    out = []
    for i, topic in enumerate(topics):
        for j, fact in enumerate(synthetic.FACTS[topic]):
            number = 2 * i + j
            others = [synthetic.FACTS[topics[(i + k) % len(topics)]][j] for k in range(1, CHOICES)]
            answer = number % CHOICES
            choices = others[:answer] + [fact] + others[answer:]
            template = synthetic.QUESTIONS[number % len(synthetic.QUESTIONS)]
            question = synthetic.format_prompt(template.format(t=topic))
            out.append({"question": question, "choices": choices, "answer": answer})
    return out


def load(**_: Any) -> dict[str, Any]:
    """lm-eval's custom_dataset hook: the rows as a `datasets` split named test."""
    import datasets

    return {"test": datasets.Dataset.from_list(rows())}
