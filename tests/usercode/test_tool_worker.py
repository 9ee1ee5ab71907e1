"""Tools and environments as code (issue 58) in the reward-function worker: a tool's result, its error, an
unknown tool and arguments that do not fit are observations; a hanging tool is one line and the worker is
stopped; the schemas come from the type hints and docstrings; an environment keeps a state per trajectory;
the tools' source is pinned with the reward functions (an edited tool is refused at the task)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kubealign import pod, tasks
from kubealign.config import load_config
from kubealign.config.ppo import PPOConfig
from kubealign.config.schema import RewardsConfig
from kubealign.config.tools import ToolsConfig
from kubealign.errors import UserError
from kubealign.rl import multiturn as mt
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner
from tests.rl.test_multiturn import CHARS, prompts, scripted
from tests.support.chars import EOS

pytestmark = pytest.mark.integration  # a worker process per test: seconds

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError(f"cannot take {x}")


def sleepy() -> str:
    """Never answers."""
    time.sleep(60)
    return ""


def peek(name: str) -> str:
    """An adversary's tool: a variable of its environment, and the trainer's environment through /proc.

    Args:
        name: the variable
    """
    import os

    mine = os.environ.get(name, "absent")
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            theirs = "read" if name.encode() in f.read() else "not there"
    except OSError as exc:
        theirs = f"refused ({exc.strerror})"
    return f"{mine}; trainer: {theirs}"


class Guess:
    """An environment: guess the row's answer; each wrong guess is told higher or lower."""

    def reset(self, row):
        self.answer, self.tries = int(row["answer"]), 0
        return "guess a number"

    def step(self, action):
        self.tries += 1
        guess = int(action.strip() or 0)
        if guess == self.answer:
            return None, 1.0, True
        return ("higher" if guess < self.answer else "lower"), -0.1, self.tries >= 3
'''


@pytest.fixture
def tools_dir(tmp_path: Path) -> Path:
    (tmp_path / "tools.py").write_text(TOOLS, encoding="utf-8")
    return tmp_path


def runner_for(directory: Path, timeout_s: float = 10.0, **tools) -> FunctionRunner:
    tools = {"functions": [{"path": f"tools.py:{n}"} for n in ("add", "boom", "sleepy")], **tools}  # or the given
    specs = definitions.resolve_tools(ToolsConfig(**tools), str(directory))
    return FunctionRunner(specs, timeout_s)


def test_results_and_errors_are_observations(tools_dir: Path):
    calls = [
        {"name": "add", "arguments": {"a": 2, "b": 40}},
        {"name": "boom", "arguments": {"x": "it"}},
        {"name": "mul", "arguments": {}},
        {"name": "add", "arguments": {"a": 1}},
    ]
    with runner_for(tools_dir) as runner:
        out = runner.tool_calls(calls, 2048)
    assert out[0] == ("42", False)
    assert out[1] == ("ValueError: cannot take it (tools.py, line 21)", True)
    assert out[2] == ("unknown tool 'mul' (tools: add, boom, sleepy)", True)
    assert out[3] == ("add: missing a required argument: 'b'", True)


TRAINER = """
import json, sys
from kubealign.config.tools import ToolsConfig
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner
specs = definitions.resolve_tools(ToolsConfig(functions=[{"path": "tools.py:peek"}]), sys.argv[1])
with FunctionRunner(specs, 30.0) as runner:
    ((text, error),) = runner.tool_calls([{"name": "peek", "arguments": {"name": "AWS_SECRET_ACCESS_KEY"}}], 2048)
print(json.dumps({"text": text, "error": error, "confined": runner.confined}))
"""


def test_a_tool_reaches_no_credential_of_the_trainer(tools_dir: Path):
    """A trainer with a credential in its environment (this test's uid: root here, whose worker would keep
    CAP_SYS_PTRACE but for sandbox.drop_capabilities) and a tool that looks for it in its own environment and
    in the trainer's /proc/PID/environ."""
    import os
    import subprocess
    import sys

    from kubealign.usercode import sandbox

    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "probe-secret-9a2b"}
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tools_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["error"] and out["text"].startswith("absent; trainer: ")  # its own environment is scrubbed
    assert "read" not in out["text"]
    if sandbox.landlock_abi() >= 1:
        assert out["text"] == "absent; trainer: refused (Permission denied)"
        assert "; no capabilities" in out["confined"] or "; no capability but reading files" in out["confined"]


def test_a_hanging_tool_is_one_line_and_the_worker_is_stopped(tools_dir: Path):
    runner = runner_for(tools_dir, timeout_s=1.0)
    with (
        runner,
        pytest.raises(
            UserError, match=r"^tool sleepy \(tools.functions\[2\].path\): no answer within rewards.timeout_s 1 s"
        ),
    ):
        runner.tool_calls([{"name": "sleepy", "arguments": {}}], 2048)
    assert runner.process is None


def test_the_schemas_come_from_type_hints_and_docstrings(tools_dir: Path):
    with runner_for(tools_dir) as runner:
        schemas = runner.schemas()
    assert [s["function"]["name"] for s in schemas] == ["add", "boom", "sleepy"]
    add = schemas[0]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first"},
        "b": {"type": "integer", "description": "the second"},
    }


def test_an_environment_keeps_a_state_per_trajectory_and_its_rewards_add_up(tools_dir: Path):
    from kubealign.data.phases import Rows

    specs = definitions.resolve_tools(ToolsConfig(environment="tools.py:Guess"), str(tools_dir))
    rows = Rows(["a", "b"], {"answer": [5, 9]}, ["d.jsonl:1", "d.jsonl:2"])
    ids, mask = prompts("a", "b")
    # row 0 guesses 3, then 5 (right); row 1 guesses 9 at once
    turns = [["3§", "9§"], ["5§"]]
    with FunctionRunner(specs, 10.0) as runner:
        session = mt.ToolSession(ToolsConfig(environment="tools.py:Guess", max_turns=3), runner, CHARS)
        batch = mt.rollout(None, ids, mask, PPOConfig(samples_per_prompt=1), session, rows, scripted(turns, []))
    trajectory = CHARS.decode(batch.input_ids[0, 1:][batch.trajectory_mask[0].bool()])
    assert trajectory == "guess a number3</s>higher5</s>"
    assert CHARS.decode(batch.input_ids[0, 1:][batch.response_mask[0].bool()]) == "3</s>5</s>"
    assert batch.env_rewards == pytest.approx([0.9, 1.0])
    assert batch.turns.tolist() == [2, 1]
    assert int(batch.input_ids[1, -1]) in (EOS, 0)


def test_an_environment_that_raises_names_the_row(tools_dir: Path):
    from kubealign.data.phases import Rows

    specs = definitions.resolve_tools(ToolsConfig(environment="tools.py:Guess"), str(tools_dir))
    rows = Rows(["a"], {"answer": ["x"]}, ["d.jsonl:4"])
    ids, mask = prompts("a")
    with FunctionRunner(specs, 10.0) as runner, pytest.raises(UserError) as raised:
        session = mt.ToolSession(ToolsConfig(environment="tools.py:Guess"), runner, CHARS)
        mt.rollout(None, ids, mask, PPOConfig(samples_per_prompt=1), session, rows, scripted([["1§"]], []))
    assert str(raised.value).startswith("environment Guess (tools.environment): reset: ValueError: invalid literal")
    assert str(raised.value).endswith("on row d.jsonl:4")


def test_an_edited_tool_is_refused_at_the_task(tools_dir: Path, monkeypatch):
    (tools_dir / "c.yaml").write_text("tools: {functions: [{path: tools.py:add}]}\n", encoding="utf-8")
    config = load_config(str(tools_dir / "c.yaml"), [])
    compiled = definitions.to_json(definitions.resolve_all(config.rewards, config.tools, config.base_dir))
    assert '"kind":"tool"' in compiled and hashlib.sha256(TOOLS.encode()).hexdigest() in compiled
    for key, value in tasks.pins(config, compiled).items():
        monkeypatch.setenv(key, value)
    assert [(s.name, s.kind) for s in tasks.reward_functions(config, compiled)] == [("add", "tool")]
    edited = compiled.replace("return a + b", "return a - b")
    with pytest.raises(UserError, match=r"^reward_functions: sha256 \w+… is not the \w+… compiled into the pipeline"):
        tasks.reward_functions(config, edited)
    monkeypatch.delenv(pod.FUNCTIONS_SHA_ENV)
    other = definitions.resolve_tools(ToolsConfig(functions=[{"path": "tools.py:boom"}]), str(tools_dir))
    with pytest.raises(UserError, match=r"does not match rewards.functions and tools .*\['tools.py:boom'\] vs"):
        tasks.reward_functions(config, definitions.to_json(other))  # compiled with another tool


def test_specs_compiled_before_tools_existed_are_reward_functions():
    specs = definitions.from_json(
        '[{"index": 0, "name": "f", "path": "f.py:f", "weight": 1.0, "source": "", "sha256": ""}]'
    )
    assert specs[0].kind == "reward" and specs[0].field == "rewards.functions[0].path"
    definitions.check_matches(specs, RewardsConfig(functions=[{"path": "f.py:f"}]), ToolsConfig())
