"""What each task of a Label Studio export must hold before kubealign reads it, checked whole first: the export a
list of task objects, each with its `data` (prompt, answer1, answer2: text that can be written as UTF-8), its
`meta.kubealign` as push writes it (answer1 / answer2 as 'alias:version', the registered model's name) and its
`annotations` (a list of objects whose `result` is a list of objects). Anything else is one line naming the task
and the field: the export comes from a server, and whoever can edit a project's tasks writes what it holds."""

from __future__ import annotations

import re
from typing import Any

from kubealign.errors import UserError

FIELDS = ("prompt", "answer1", "answer2")
SIDE = re.compile(r"[^:\s]+:[0-9]+")  # alias:version, as pairs.Side.label writes it


def kind(value: Any) -> str:
    return {dict: "an object", list: "a list", type(None): "null"}.get(type(value), repr(value)[:40])


def checked(export: Any) -> list[dict[str, Any]]:
    """The export's tasks, each checked (module docstring); UserError "the export: task ID: ..." otherwise."""
    if not isinstance(export, list):
        what = "a JSON object" if isinstance(export, dict) else kind(export)
        raise UserError(f"the export: {what}, not a list of tasks")
    for number, task in enumerate(export, 1):
        if not isinstance(task, dict):
            raise UserError(f"the export: task #{number} is {kind(task)}, not an object")
        name = task.get("id") if isinstance(task.get("id"), int) else f"#{number}"
        problem = data_problem(task) or meta_problem(task) or annotations_problem(task)
        if problem:
            raise UserError(f"the export: task {name}: {problem}")
    return export


def data_problem(task: dict[str, Any]) -> str | None:
    data = task.get("data")
    if not isinstance(data, dict):
        return f"data is {kind(data)}, not an object"
    for field in FIELDS:
        if field not in data:
            return f"data.{field} is missing"
        text = data[field]
        if not isinstance(text, str):
            return f"data.{field} is {kind(text)}, not text"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"data.{field} cannot be written as UTF-8 (a lone surrogate at character {exc.start})"
    return None


def meta_problem(task: dict[str, Any]) -> str | None:
    meta = task.get("meta")
    ours = meta.get("kubealign", "missing") if isinstance(meta, dict) else "missing"
    if not isinstance(ours, dict):
        what = "missing" if ours == "missing" else f"{kind(ours)}, not an object"
        return f"meta.kubealign is {what} (tasks kubealign pushes say which models answered)"
    for side in ("answer1", "answer2"):
        label = ours.get(side)
        if not isinstance(label, str) or not SIDE.fullmatch(label):
            return f"meta.kubealign.{side} is {kind(label)}, not 'alias:version'"
    model = ours.get("registered_model")
    if model is not None and not (isinstance(model, str) and model):
        return f"meta.kubealign.registered_model is {kind(model)}, not a registered model's name"
    return None


def annotations_problem(task: dict[str, Any]) -> str | None:
    annotations = task.get("annotations", [])
    if not isinstance(annotations, list):
        return f"annotations is {kind(annotations)}, not a list"
    for number, annotation in enumerate(annotations):
        if not isinstance(annotation, dict):
            return f"annotations[{number}] is {kind(annotation)}, not an object"
        results = annotation.get("result", [])
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            return f"annotations[{number}].result is not a list of objects"
        values = [r.get("value", {}) for r in results]
        if not all(isinstance(v, dict) and isinstance(v.get("selected", ""), str) for v in values):
            return f"annotations[{number}].result holds a value that is not an object with a `selected` text"
        who = annotation.get("completed_by")
        if who is not None and not isinstance(who, int):
            return f"annotations[{number}].completed_by is {kind(who)}, not a user id"
    return None
