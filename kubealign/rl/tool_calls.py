"""The tool-call format of multi-turn rollouts: pure functions of text.

The Hermes markup, which Qwen's, Hermes's and other chat templates use for tools and vLLM's `hermes` tool
parser reads:

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 + 589"}}</tool_call>
    <tool_response>936</tool_response>

A turn of the model ends at CALL_CLOSE (or EOS, or the token budget); `parse` reads the first call of the
turn. A call that is not JSON, has no string "name" or arguments that are not an object is `Malformed`: the
rollout answers it with an error observation, so the model can learn from it, instead of failing.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from kubealign.data.tokenize import RESULT_CLOSE, RESULT_OPEN  # noqa: F401 - SFT masks these spans too

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Characters of a tool's result (or an environment's observation) kept per token of its budget, cut in the worker
# before the trainer reads or tokenizes it: a token of natural text or code spans well under 32 characters, so the
# budget's tokens are still there to keep; a result of longer tokens is cut to fewer. Without the cut a tool that
# returned 30 MiB cost the trainer 112 s and 9.9 GiB of tokenizing, outside the worker's limits.
CHARS_PER_TOKEN = 32


def result_chars(tokens: int) -> int:
    """The characters of a tool result or an observation kept for a budget of `tokens` tokens."""
    return tokens * CHARS_PER_TOKEN


class Call(NamedTuple):
    name: str
    arguments: dict[str, Any]


class Malformed(NamedTuple):
    reason: str  # what the observation tells the model


def parse(turn: str) -> Call | Malformed | None:
    """The first tool call of a model turn; None when the turn calls nothing (the answer is final)."""
    start = turn.find(CALL_OPEN)
    if start < 0:
        return None
    body_start = start + len(CALL_OPEN)
    end = turn.find(CALL_CLOSE, body_start)
    if end < 0:
        return Malformed(f"a call must end with {CALL_CLOSE}")
    body = turn[body_start:end].strip()
    try:
        call = json.loads(body)
    except ValueError as exc:
        return Malformed(f"not JSON: {exc.msg} at character {exc.pos}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Malformed('a call is {"name": TOOL, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return Malformed("arguments is a string that is not JSON")
    if not isinstance(arguments, dict):
        return Malformed("arguments must be an object")
    return Call(call["name"], arguments)


# a '<' that opens what reads as the markup (<tool_call>, </tool_response>, <tools>, spaced or in any case)
_MARKUP = re.compile(r"<(?=\s*/?\s*tool)", re.IGNORECASE)


def escape(text: str) -> str:
    """Text the model did not write (a tool's result, an environment's observation) with every '<' that starts
    what reads as the markup written '&lt;': the trajectory the model sees and reward functions read then holds
    only the calls the model made and the responses the rollout wrote, whatever a tool answers."""
    return _MARKUP.sub("&lt;", text)


def response(text: str, error: bool = False) -> str:
    """The observation that answers a call: the tool's result, or the error prefixed 'error: ', escaped."""
    return f"{RESULT_OPEN}{'error: ' if error else ''}{escape(text)}{RESULT_CLOSE}"


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model should write it (demonstrations, tests)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def tools_block(schemas: list[dict[str, Any]]) -> str:
    """The tools shown to the model before a prompt (tools.show_schemas), as Hermes's system text does."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return f"You may call these tools, each as {CALL_OPEN}{{...}}{CALL_CLOSE}:\n<tools>\n{lines}\n</tools>\n"
