"""The tools demo's data (issue 58): three-digit sums, demonstrations in the configured shares of habits, the
tool and the reward function shipped with the tiny-cpu-tools preset."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from kubealign.config import load_config
from kubealign.data import tool_arithmetic as ta
from kubealign.rl import tool_calls
from kubealign.usercode import definitions
from tests.conftest import REPO

pytestmark = pytest.mark.unit
QUESTION = re.compile(r"Human: (.*)\n\nAssistant:$", re.S)


def _operands(prompt: str) -> tuple[int, int]:
    a, b = (int(x) for x in re.findall(r"\d+", QUESTION.search(prompt).group(1)))
    return a, b


def _load(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "configs" / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pure_function_of_the_seed_with_a_text_per_row():
    rows = ta.generate(70, 130, seed=0)
    assert rows == ta.generate(70, 130, seed=0) and rows != ta.generate(70, 130, seed=1)
    assert [set(r) for r in rows] == [{"prompt", "response"}] * 130 + [{"prompt", "answer"}] * 70
    assert len({r["prompt"] for r in rows}) == 200
    for row in rows[130:]:
        a, b = _operands(row["prompt"])
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["answer"] == a + b


@pytest.mark.parametrize("sft_rows", [4, 9, 400])
def test_the_demonstrations_habits_come_in_the_configured_shares(sft_rows: int):
    kinds = []
    for row in ta.generate(0, sft_rows, seed=3):
        a, b = _operands(row["prompt"])
        call = tool_calls.parse(row["response"])
        if call is None:
            assert row["response"] == f" {a + b}"
            kinds.append("direct")
            continue
        assert call == tool_calls.Call("add", {"a": a, "b": b})
        told, _, final = row["response"].rpartition("</tool_response>")
        assert told.endswith(f"<tool_response>{a + b}") and final in (f" {a + b}", f" {a}")
        kinds.append("call" if final == f" {a + b}" else "miscopy")
    assert kinds.count("call") == round(ta.CALL_SHARE * sft_rows)
    assert kinds.count("miscopy") == round(ta.MISCOPY_SHARE * sft_rows)


def test_the_demonstrations_call_is_the_rollouts_format():
    assert ta.call(347, 589) == tool_calls.call_text("add", {"a": 347, "b": 589})
    assert json.loads(ta.call(1, 2)[len("<tool_call>") : -len("</tool_call>")])["arguments"] == {"a": 1, "b": 2}


def test_the_shipped_tool_and_reward_function():
    assert _load("tools/calculator.py", "calculator").add(347, 589) == 936
    final_answer = _load("rewards/tool_arithmetic.py", "tool_arithmetic").final_answer
    completions = [
        ta.call(347, 589) + "<tool_response>936</tool_response> 936",
        ta.call(347, 589) + "<tool_response>936</tool_response> 347",
        " 936",
        "<tool_response>936</tool_response> 9360",
        "anything",
    ]
    assert final_answer(["p"] * 5, completions, [936, 936, 936, 936, None]) == [1.0, 0.0, 1.0, 0.0, None]


def test_the_preset_resolves_its_tool_and_reward_function():
    config = load_config("tiny-cpu-tools")
    specs = definitions.resolve_all(config.rewards, config.tools, config.base_dir)
    assert [(s.name, s.kind) for s in specs] == [("final_answer", "reward"), ("add", "tool")]
    assert all(s.source for s in specs)
