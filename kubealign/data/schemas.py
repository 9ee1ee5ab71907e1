"""Row schemas: recognize a raw row and normalize it to {prompt, chosen, rejected or None}.

Recognized schemas (`format` of a source; 'auto' detects per row from its keys):

* prompt_chosen_rejected — {"prompt", "chosen", "rejected"?} (Dahoas/rm-static style; extra keys such
  as "response" are ignored). A row without "rejected" is an SFT-only row.
* hh — {"chosen", "rejected"}: two full HH-RLHF dialogues. The prompt is the chosen text through its
  last "\\n\\nAssistant:"; each response is the rest. Dialogues that differ before the last reply
  are dropped (reason prompt_mismatch).
* prompt_response — {"prompt", "response"}: SFT-only rows.
* prompt_completion — {"prompt", "completion"} (TRL's prompt-completion format): SFT-only rows, the
  completion the demonstration; in its conversational form both are message lists (the prompt's turns,
  then one assistant message as the completion).
* messages — {"messages": [{"role", "content"}, ...]} ending in an assistant turn (SFT-only), or
  {"chosen": [...], "rejected": [...]} message lists sharing all turns but the last.
* prompt_only — {"prompt", ...} with no response: a prompt for phase 3 only (PPO / GRPO / RLOO and
  evaluate); its other fields are kept as the row's columns, which reward functions get. A field whose
  name says it holds a response (ANSWER_LIKE: "answer", "completion", "output", "text", ...) is refused
  unless the source declares it a column (`data.sources[i].columns`): a demonstration under an unknown
  name would otherwise turn an SFT row into a prompt without a word.

Message lists are rendered in the plain HH dialogue format: "\\n\\nHuman: ...\\n\\nAssistant: ..."
(a system turn renders as "\\n\\nSystem: ..."), the prompt ending in "\\n\\nAssistant:" and the
response starting with a space. A malformed row raises RowError (a field and a message); a well-formed
row that cannot be used raises RowDrop (a reason counted in the manifest).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

ASSISTANT = "\n\nAssistant:"
ROLE_LABELS = {"user": "Human", "human": "Human", "assistant": "Assistant", "system": "System"}
# Fields of a prompt-only row that name a response more often than a column: kept only when declared.
ANSWER_LIKE = (
    "answer",
    "answers",
    "completion",
    "output",
    "outputs",
    "text",
    "solution",
    "response",
    "reply",
    "target",
    "chosen",
    "rejected",
    "assistant",
    "ground_truth",
)


class Pair(NamedTuple):
    prompt: str
    chosen: str | None  # None: a prompt-only row
    rejected: str | None
    columns: str | None = None  # a prompt-only row's other fields, canonical JSON of an object


class RowError(Exception):
    """A malformed row. `field` names the offending key (None when the row as a whole is wrong)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

    def describe(self) -> str:
        return f"field '{self.field}': {self.message}" if self.field else self.message


class RowDrop(Exception):
    """A well-formed row that cannot be used; `reason` is a manifest drop-report key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _string(row: dict[str, Any], key: str, optional: bool = False) -> str | None:
    if key not in row or (optional and row[key] is None):
        if optional:
            return None
        raise RowError(key, "missing")
    value = row[key]
    if not isinstance(value, str):
        raise RowError(key, f"expected a string, got {_type_name(value)}")
    return value


def detect_format(row: dict[str, Any]) -> str:
    """Pick the schema of a row from its keys; RowError if none fits."""
    if "messages" in row or isinstance(row.get("chosen"), list):
        return "messages"
    if "prompt" in row and "chosen" in row:
        return "prompt_chosen_rejected"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "prompt" in row and "response" in row:
        return "prompt_response"
    if "chosen" in row and "rejected" in row:
        return "hh"
    if "prompt" in row and not {"chosen", "rejected", "response"} & set(row):
        return "prompt_only"
    keys = ", ".join(sorted(map(str, row))[:8]) or "none"
    raise RowError(
        None,
        "no recognizable fields (expected prompt/chosen/rejected, chosen/rejected dialogues, "
        f"prompt/response, prompt/completion or messages; found keys: {keys})",
    )


def split_dialogue(text: str, field: str) -> tuple[str, str]:
    """HH dialogue -> (prompt through the last '\\n\\nAssistant:', the final reply)."""
    cut = text.rfind(ASSISTANT)
    if cut < 0:
        raise RowError(field, 'no "\\n\\nAssistant:" turn in the dialogue')
    end = cut + len(ASSISTANT)
    return text[:end], text[end:]


def _hh(row: dict[str, Any]) -> Pair:
    prompt, chosen = split_dialogue(_string(row, "chosen"), "chosen")
    rejected_prompt, rejected = split_dialogue(_string(row, "rejected"), "rejected")
    if rejected_prompt != prompt:
        raise RowDrop("prompt_mismatch")
    return Pair(prompt, chosen, rejected)


def _message_parts(messages: Any, field: str) -> list[tuple[str, str]]:
    """Message list -> [(role label, content)], each message checked."""
    if not isinstance(messages, list) or not messages:
        raise RowError(field, f"expected a non-empty list of messages, got {_type_name(messages)}")
    parts = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise RowError(where, f"expected an object with role and content, got {_type_name(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLE_LABELS:
            raise RowError(f"{where}.role", f"expected one of {sorted(ROLE_LABELS)}, got {role!r}")
        if not isinstance(content, str):
            raise RowError(f"{where}.content", f"expected a string, got {_type_name(content)}")
        parts.append((ROLE_LABELS[role], content))
    return parts


def _render_turns(parts: list[tuple[str, str]]) -> str:
    """[(label, content)] -> the dialogue through an open assistant turn: "\n\nHuman: ...\n\nAssistant:"."""
    return "".join(f"\n\n{label}: {content}" for label, content in parts) + ASSISTANT


def _render_messages(messages: Any, field: str) -> tuple[str, str]:
    """Message list -> (rendered prompt, final assistant reply)."""
    parts = _message_parts(messages, field)
    if parts[-1][0] != "Assistant":
        raise RowError(f"{field}[{len(parts) - 1}].role", "the last message must be the assistant's")
    return _render_turns(parts[:-1]), " " + parts[-1][1]


def _messages(row: dict[str, Any]) -> Pair:
    if "messages" in row:
        prompt, reply = _render_messages(row["messages"], "messages")
        return Pair(prompt, reply, None)
    if "chosen" not in row or "rejected" not in row:
        raise RowError("messages", "missing (or chosen/rejected message lists)")
    prompt, chosen = _render_messages(row["chosen"], "chosen")
    rejected_prompt, rejected = _render_messages(row["rejected"], "rejected")
    if rejected_prompt != prompt:
        raise RowDrop("prompt_mismatch")
    return Pair(prompt, chosen, rejected)


def _prompt_completion(row: dict[str, Any]) -> Pair:
    """TRL's prompt-completion row, standard (two strings, joined as they are) or conversational (message
    lists: the prompt's turns, none of them the last assistant reply, and the completion's one assistant
    message, rendered as the messages format renders them)."""
    if isinstance(row.get("prompt"), str) or isinstance(row.get("completion"), str):
        return Pair(_string(row, "prompt"), _string(row, "completion"), None)
    turns = _message_parts(row.get("prompt"), "prompt")
    if turns[-1][0] == "Assistant":
        raise RowError(f"prompt[{len(turns) - 1}].role", "the prompt must end before the assistant's reply")
    reply = _message_parts(row.get("completion"), "completion")
    if len(reply) != 1 or reply[0][0] != "Assistant":
        raise RowError("completion", "expected one assistant message")
    return Pair(_render_turns(turns), " " + reply[0][1], None)


def _prompt_only(row: dict[str, Any], declared: frozenset[str]) -> Pair:
    prompt = _string(row, "prompt")
    columns = {k: v for k, v in row.items() if k != "prompt"}
    for key in columns:
        if key.lower() in ANSWER_LIKE and key not in declared:
            raise RowError(
                key,
                "looks like the row's answer, not a column: list it in the source's `columns` "
                "to give it to reward functions, or name it `completion` to train on it",
            )
    try:  # what the functions get must survive JSON (the worker protocol, the saved dataset)
        text = json.dumps(columns, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RowError(None, f"a prompt-only row's fields must be JSON values ({exc})") from None
    return Pair(prompt, None, None, text)


def normalize(row: Any, fmt: str = "auto", columns: frozenset[str] = frozenset()) -> Pair:
    """Normalize one raw row. columns: the fields the source declares columns (prompt-only rows keep them
    whatever their name). Raises RowError (malformed) or RowDrop (unusable)."""
    if not isinstance(row, dict):
        raise RowError(None, f"expected a JSON object, got {_type_name(row)}")
    if fmt == "auto":
        fmt = detect_format(row)
    if fmt == "prompt_chosen_rejected":
        return Pair(_string(row, "prompt"), _string(row, "chosen"), _string(row, "rejected", optional=True))
    if fmt == "prompt_response":
        return Pair(_string(row, "prompt"), _string(row, "response"), None)
    if fmt == "prompt_completion":
        return _prompt_completion(row)
    if fmt == "hh":
        return _hh(row)
    if fmt == "messages":
        return _messages(row)
    if fmt == "prompt_only":
        return _prompt_only(row, columns)
    raise ValueError(f"unknown format {fmt!r}")  # the config schema only admits the names above


def row_problem(pair: Pair) -> str | None:
    """Row-level quality checks after normalization: a drop reason, or None if the row is usable."""
    if not pair.prompt.strip():
        return "empty_prompt"
    if pair.chosen is None:  # a prompt-only row
        return None
    if not pair.chosen.strip():
        return "empty_chosen"
    if pair.rejected is not None:
        if not pair.rejected.strip():
            return "empty_rejected"
        if pair.rejected.strip() == pair.chosen.strip():
            return "chosen_equals_rejected"
    return None
