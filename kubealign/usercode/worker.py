"""The reward-function worker: `python -m kubealign.usercode.worker`, driven by kubealign.usercode.runner.

It loads the functions once and answers one JSON request per line on stdin with one JSON line on its
own copy of stdout; whatever the functions print goes to stderr, so it cannot break the protocol. It caps its
own memory (MEMORY_ENV) and, started by FunctionRunner, confines itself (kubealign.usercode.sandbox) before it
loads any user code; its first line says what the sandbox holds. It runs in a process of its own so that a
function that hangs (even inside C code) can be killed when the per-call timeout runs out, and a crash in
user code cannot take the training process with it. It imports nothing heavy (no torch): it starts in well
under a second.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 2000  # of an exception's message: an error is one line, whatever the user's code raised


def _describe(exc: BaseException) -> str:
    """'Type: message' of an exception, with the user file's line where the traceback has one."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1][:MESSAGE_CHARS]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.endswith("worker.py")]
    return f"{text} ({frames[-1].filename}, line {frames[-1].lineno})" if frames else text


class LoadError(Exception):
    """The function's file or module cannot be loaded, or has no such function, or a wrong signature."""


def load(spec: dict[str, Any]) -> Any:
    """The function a spec names: exec'd from its embedded source, or imported from its module."""
    where, _, name = spec["path"].rpartition(":")
    try:
        if spec["source"] is not None:
            module = types.ModuleType(f"kubealign_reward_fn_{spec['index']}")
            module.__file__ = where
            sys.modules[module.__name__] = module  # dataclasses and pickle look a module up by name
            exec(compile(spec["source"], where, "exec"), module.__dict__)  # noqa: S102 - the user's own reward code
        else:
            module = importlib.import_module(where)
    except BaseException as exc:  # SyntaxError, ImportError, anything its top level raises
        raise LoadError(f"cannot load {where}: {_describe(exc)}") from None
    if not hasattr(module, name):
        raise LoadError(f"{where} has no function {name}")
    function = getattr(module, name)
    kind = spec.get("kind", "reward")
    if kind == "environment":
        missing = [m for m in ("reset", "step") if not callable(getattr(function, m, None))]
        if not isinstance(function, type) or missing:
            raise LoadError(f"{name} in {where} is not an environment class with reset(row) and step(action)")
        return function
    if not callable(function):
        raise LoadError(f"{name} in {where} is a {type(function).__name__}, not a function")
    if kind == "tool":  # called with the call's arguments as keywords: any signature may fit some call
        return function
    try:
        parameters = inspect.signature(function).parameters.values()
    except ValueError:  # a builtin without a signature: a call will say what is wrong
        return function
    kinds = [p.kind for p in parameters]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    if positional < 2 and inspect.Parameter.VAR_POSITIONAL not in kinds:
        raise LoadError(
            f"{name}{inspect.signature(function)} cannot be called as {name}(prompts, completions, **columns)"
        )
    return function


def _call(function: Any, request: dict[str, Any]) -> dict[str, Any]:
    try:
        inspect.signature(function).bind(request["prompts"], request["completions"], **request["columns"])
    except TypeError as exc:
        return {"error": "signature", "message": f"cannot take the columns {sorted(request['columns'])}: {exc}"}
    except ValueError:
        pass
    try:
        values = function(request["prompts"], request["completions"], **request["columns"])
    except MemoryError:  # the worker's address-space limit (kubealign.usercode.runner): not the function's bug
        return {"error": "memory", "memory": True, "message": "MemoryError"}
    except Exception as exc:  # the user's code: report, do not die
        return {"error": "raised", "message": _describe(exc)}
    try:
        values = list(values)
    except TypeError:
        return {"error": "type", "message": f"returned a {type(values).__name__}, expected a list of floats or None"}
    out = []
    for i, value in enumerate(values):
        if value is None or isinstance(value, bool | int | float):
            out.append(None if value is None else float(value))
        else:
            return {
                "error": "value",
                "row": i,
                "message": f"returned {value!r} ({type(value).__name__}), expected a float or None",
            }
    # JSON has no nan/inf: they travel as strings and are refused by the caller with the row named
    return {"values": [v if v is None or v == v and abs(v) != float("inf") else repr(v) for v in out]}


def _tool_calls(functions: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """Each call {name, arguments} -> {"result": text} or {"error": text}: a tool that raises, an unknown tool
    and arguments that do not fit are the model's mistakes, answered as observations it can learn from."""
    results, chars = [], request.get("max_chars")  # what a result may hold: cut here, before the trainer reads it
    for call in request["calls"]:
        function = functions.get(call["name"]) if call["name"] in request["tools"] else None
        if function is None:
            results.append({"error": f"unknown tool {call['name']!r} (tools: {', '.join(request['tools'])})"})
            continue
        try:
            inspect.signature(function).bind(**call["arguments"])
        except TypeError as exc:
            results.append({"error": f"{call['name']}: {exc}"})
            continue
        except ValueError:
            pass
        try:
            results.append({"result": str(function(**call["arguments"]))[:chars]})
        except MemoryError:
            return {"error": "memory", "memory": True, "message": "MemoryError"}
        except Exception as exc:  # the tool's error is the observation
            results.append({"error": _describe(exc)[:chars]})
    return {"results": results}


def _schemas(functions: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The tools' JSON schemas from their type hints and docstrings (transformers' get_json_schema, what
    chat templates and TRL show a model), imported here only: the worker stays light for reward functions."""
    from transformers.utils import get_json_schema

    try:
        return {"schemas": [get_json_schema(functions[n]) for n in names]}
    except Exception as exc:  # a tool without type hints or a docstring
        return {"error": "schema", "message": _describe(exc)}


class _Environments:
    """The environment instances of the trajectories in flight, by slot (one per trajectory)."""

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}

    def reset(self, cls: Any, request: dict[str, Any]) -> dict[str, Any]:
        self.live.clear()
        observations = []
        for slot, row in zip(request["slots"], request["rows"], strict=True):
            try:
                self.live[slot] = cls()
                observation = self.live[slot].reset(row)
            except Exception as exc:
                return {"error": "raised", "message": f"reset: {_describe(exc)}", "row": len(observations)}
            observations.append(None if observation is None else str(observation)[: request.get("max_chars")])
        return {"observations": observations}

    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        steps = []
        for slot, action in zip(request["slots"], request["actions"], strict=True):
            try:
                out = self.live[slot].step(action)
                observation, reward, done = out
            except Exception as exc:
                return {"error": "raised", "message": f"step: {_describe(exc)}", "row": len(steps)}
            if reward is not None and not isinstance(reward, bool | int | float):
                return {"error": "value", "message": f"step returned the reward {reward!r}", "row": len(steps)}
            steps.append(
                {
                    "observation": None if observation is None else str(observation)[: request.get("max_chars")],
                    "reward": None if reward is None else float(reward),
                    "done": bool(done),
                }
            )
        return {"steps": steps}


MEMORY_ENV = "KUBEALIGN_WORKER_MEMORY_MB"
FILE_LIMIT_ENV = "KUBEALIGN_WORKER_FILE_LIMIT_MB"
NETWORK_ENV = "KUBEALIGN_WORKER_NETWORK"
PROCESSES_ENV = "KUBEALIGN_WORKER_MAX_PROCESSES"
HIDDEN_ENV = "KUBEALIGN_WORKER_HIDDEN"  # a directory the worker may not read: kubealign's cache


def limit_self(memory_mb: int) -> None:
    """This process's address space capped at memory_mb (an allocation past it fails with MemoryError), and
    this process first in line for the OOM killer, so that a function's appetite never costs the trainer."""
    import resource

    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as adj:
            adj.write("1000")
    except OSError:  # not Linux, or /proc read-only: the rlimit still holds
        pass


def main() -> int:
    if os.environ.get(MEMORY_ENV):
        limit_self(int(os.environ[MEMORY_ENV]))
    confined = ""
    if os.environ.get(FILE_LIMIT_ENV):  # started by FunctionRunner: confine before any user code
        from kubealign.usercode.sandbox import confine
        from kubealign.usercode.tree import nproc_limit

        hidden = Path(os.environ[HIDDEN_ENV]) if os.environ.get(HIDDEN_ENV) else None
        confined = confine(Path.cwd(), int(os.environ[FILE_LIMIT_ENV]), bool(os.environ.get(NETWORK_ENV)), hidden)
        confined += f"; {nproc_limit(int(os.environ.get(PROCESSES_ENV) or 64))}"
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the functions' print() goes to stderr
    sys.stdout = sys.stderr
    protocol.write(json.dumps({"confined": confined}) + "\n")  # the greeting: what the sandbox holds
    protocol.flush()
    functions: dict[str, Any] = {}
    environments = _Environments()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "load":  # one spec per request, so that an error names its function
            spec = request["spec"]
            try:
                functions[spec["name"]] = load(spec)
                reply: dict[str, Any] = {"ok": True}
            except LoadError as exc:
                reply = {"error": "load", "message": str(exc)}
        elif request["op"] == "tools":
            reply = _tool_calls(functions, request)
        elif request["op"] == "schemas":
            reply = _schemas(functions, request["tools"])
        elif request["op"] == "reset":
            reply = environments.reset(functions[request["name"]], request)
        elif request["op"] == "step":
            reply = environments.step(request)
        else:
            reply = _call(functions[request["name"]], request)
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
