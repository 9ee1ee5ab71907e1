"""Pairwise comparisons for Label Studio (its "tasks"): one prompt, two answers, the sides shuffled per pair.

The annotator sees the prompt and `answer1` / `answer2` under Label Studio's Pairwise control (LABEL_CONFIG:
its "human preference" pairwise layout); which model wrote which answer is kept in the task's `meta`, which
the labeling page does not show, so that kubealign can map a choice back to the two registry versions. The
side each model gets is drawn per task from a seeded generator: neither model is always on the left.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, NamedTuple

# The prompt above, the two answers side by side (A left, B right) under Label Studio's Pairwise control: a click
# on an answer chooses it (selectionStyle marks it), Submit stores {"selected": "left" | "right"}. Laid out as
# Label Studio's own "Human Preference collection for RLHF" template lays it out.
LABEL_CONFIG = """<View>
  <Style>
    .kubealign-prompt { padding: 12px 16px; margin-bottom: 12px; border-radius: 6px; background: #eef3fb; }
    .kubealign-answers { display: flex; gap: 16px; align-items: stretch; }
    .kubealign-answer { flex: 1 1 0; padding: 8px 12px; border: 1px solid #c9d1d9; border-radius: 6px; }
    .kubealign-answer .lsf-richtext__line { white-space: pre-wrap; }
  </Style>
  <Header value="Which answer is better? Click it, then Submit (Skip if you cannot tell)."/>
  <View className="kubealign-prompt">
    <Text name="prompt" value="$prompt"/>
  </View>
  <Pairwise name="comparison" toName="answer1,answer2"
            selectionStyle="background-color: #dff6e4; outline: 2px solid #2e9e4f; border-radius: 6px;"/>
  <View className="kubealign-answers">
    <View className="kubealign-answer">
      <Header value="Answer A" size="5"/>
      <Text name="answer1" value="$answer1"/>
    </View>
    <View className="kubealign-answer">
      <Header value="Answer B" size="5"/>
      <Text name="answer2" value="$answer2"/>
    </View>
  </View>
</View>"""


class Side(NamedTuple):
    alias: str  # the registry alias the answers came from: champion, challenger
    version: str  # the model version it pointed to

    @property
    def label(self) -> str:
        return f"{self.alias}:{self.version}"


def prompt_key(prompt: str) -> str:
    """A prompt's identity across pushes (a task already in the project is not pushed again)."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def pairwise_tasks(
    prompts: list[str],
    first: list[str],
    second: list[str],
    sides: tuple[Side, Side],
    seed: int,
    registered_model: str,
    judges: list[dict[str, float]] | None = None,
    extra: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One task per prompt: `first[i]` (sides[0]'s answer) and `second[i]` (sides[1]'s) as answer1 / answer2 in
    an order drawn per task; meta.kubealign says which side is which and of which registered model (the pull
    checks both against the registry). judges: per task, each automatic judge's probability that sides[1]'s answer
    is the better one, written into the meta as the probability that answer1 is (feedback.agreement reads it);
    extra: per task, more meta (feedback.served: the stratum, weight, round, judge run)."""
    rng = random.Random(f"kubealign-feedback-{seed}")
    tasks = []
    for i, (prompt, a, b) in enumerate(zip(prompts, first, second, strict=True)):
        swap = rng.random() < 0.5
        (one, one_side), (two, two_side) = ((b, sides[1]), (a, sides[0])) if swap else ((a, sides[0]), (b, sides[1]))
        meta = {"answer1": one_side.label, "answer2": two_side.label, "prompt_sha256": prompt_key(prompt)}
        meta["registered_model"] = registered_model
        if judges is not None:  # P(answer1 better): sides[1]'s probability when it is on the left
            meta["judges"] = {name: p if swap else 1.0 - p for name, p in judges[i].items()}
        meta.update(extra[i] if extra is not None else {})
        tasks.append({"data": {"prompt": prompt, "answer1": one, "answer2": two}, "meta": {"kubealign": meta}})
    return tasks


def task_key(meta: dict[str, Any]) -> str | None:
    """What a project holds once: a served comparison (meta `comparison`: the prompt and both versions, so the same
    prompt served by the next round's versions is a new task), else the prompt."""
    return meta.get("comparison") or meta.get("prompt_sha256")


def new_tasks(tasks: list[dict[str, Any]], present: set[str]) -> list[dict[str, Any]]:
    """The tasks whose key (task_key: a served comparison, else the prompt's sha256) is not in the project yet."""
    return [t for t in tasks if task_key(t["meta"]["kubealign"]) not in present]
