"""Run reward functions in a worker process (kubealign.usercode.worker) and check what they return.

Every failure is a UserError of one line naming the function (`reward function NAME
(rewards.functions[i])`) and, where it applies, the row (its data-split origin, FILE:LINE): a function
that cannot be loaded, has the wrong signature, raises, returns the wrong number of values, a value that
is not a number or None, or a non-finite one, or does not return within rewards.timeout_s (then the
worker is killed). When a batch call raises, the rows are retried one at a time to name the first row
that makes it raise.

The worker's limits (user code runs there, not in the trainer): an environment with none of the task's
variables but PATH, LANG, LC_*, TZ, PYTHONPATH and those rewards.worker_env names (so no MLflow or object-store
credentials); a private working and temporary directory, removed at the end, the only place it may write,
with no sockets unless rewards.network, nothing read under kubealign's cache, and no way to read the trainer's
/proc entries (its environment, its working directory): kubealign.usercode.sandbox; rewards.memory_limit_mb of
address space per process, past which its allocation fails and the call is one line, and for its processes
together, with rewards.max_processes of them (kubealign.usercode.tree: past either the tree is stopped with one
line), the worker first in line for the OOM killer;
rewards.file_limit_mb per file; every process it starts, detached or not, ended with it on a timeout or at
the end; its replies read with the call's deadline (half a line is a timeout, not a hang); and what it
prints, forwarded to the task's log at most OUTPUT_LIMIT bytes per call (only the last part is read).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubealign.config.cache import cache_root
from kubealign.errors import UserError
from kubealign.usercode import sandbox, tree
from kubealign.usercode.definitions import FunctionSpec
from kubealign.usercode.worker import FILE_LIMIT_ENV, HIDDEN_ENV, MEMORY_ENV, NETWORK_ENV, PROCESSES_ENV

Values = list[float | None]
KEPT_ENV = ("PATH", "LANG", "TZ", "PYTHONPATH")  # and LC_*: what a Python function may need, no credential
OUTPUT_LIMIT = 64 * 1024  # bytes of a call's printed output forwarded to the task's log
REPLY_LIMIT = 64 * 2**20  # bytes of one reply line: values for a batch are far fewer
DEFAULT_MEMORY_MB = 4096
DEFAULT_FILE_LIMIT_MB = 1024
DEFAULT_MAX_PROCESSES = 64


def worker_env(environ: dict[str, str], passed: list[str], home: Path, cwd: str) -> dict[str, str]:
    """The worker's environment: KEPT_ENV, LC_*, the names in `passed`; HOME and TMPDIR its private dir; the
    directory the stage runs in on PYTHONPATH (a module:NAME function importable there stays importable)."""
    env = {k: v for k, v in environ.items() if k in KEPT_ENV or k.startswith("LC_") or k in passed}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), cwd) if p)
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    # one thread per math library: their per-thread arenas would count against the address-space limit
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


class FunctionRunner:
    """The worker process and the loaded functions; use as a context manager (the worker is ended on exit)."""

    _unconfined_said = False

    def __init__(
        self,
        specs: list[FunctionSpec],
        timeout_s: float,
        memory_limit_mb: int = DEFAULT_MEMORY_MB,
        passed_env: list[str] | None = None,
        file_limit_mb: int = DEFAULT_FILE_LIMIT_MB,
        network: bool = False,
        max_processes: int = DEFAULT_MAX_PROCESSES,
    ):
        self.specs, self.timeout_s = specs, timeout_s
        self.memory_limit_mb, self.passed_env = memory_limit_mb, list(passed_env or [])
        self.file_limit_mb, self.network, self.max_processes = file_limit_mb, network, max_processes
        self.watch: tree.Watch | None = None  # the worker's tree, measured as a whole (memory, processes)
        self.process: subprocess.Popen | None = None
        self.home: Path | None = None
        self.output: Any = None  # the worker's stderr: a file in its private dir, drained after every call
        self.cut_said = False
        self.confined = ""  # what the worker's sandbox holds, in its own words
        self._pending = b""  # bytes of the worker's next reply read so far
        self._dumpable: int | None = None

    @classmethod
    def for_config(cls, specs: list[FunctionSpec], rewards: Any) -> FunctionRunner:
        """The runner of a stage's `rewards` section (kubealign.config.schema.RewardsConfig)."""
        r = rewards
        return cls(specs, r.timeout_s, r.memory_limit_mb, r.worker_env, r.file_limit_mb, r.network, r.max_processes)

    def __enter__(self) -> FunctionRunner:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="kubealign-reward-fn-"))
        self.output = open(self.home / ".output", "ab+")  # noqa: SIM115 - closed in close()
        env = worker_env(dict(os.environ), self.passed_env, self.home, os.getcwd())
        # the worker limits and confines itself before it loads any user code
        env.update({MEMORY_ENV: str(self.memory_limit_mb), FILE_LIMIT_ENV: str(self.file_limit_mb)})
        env[NETWORK_ENV] = "1" if self.network else ""
        env[PROCESSES_ENV] = str(self.max_processes)
        env[HIDDEN_ENV] = str(cache_root())  # the canary fronts' tokens, the built models: none of the worker's
        with contextlib.suppress(OSError, AttributeError):  # not Linux (no prctl): no /proc to close
            self._dumpable = sandbox.undumpable()  # this process's /proc entries: root's while a worker runs
        try:
            self._launch(env)
        except BaseException:  # a load error or a worker that never greets: nothing left running
            self.close()
            raise

    def _launch(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kubealign.usercode.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.output,
            env=env,
            cwd=self.home,
            start_new_session=True,  # its own process group
        )
        self.watch = tree.Watch(self.process.pid, self.memory_limit_mb, self.max_processes)
        first = self.specs[0] if self.specs else None
        self.confined = self._read_reply(first, "starting it").get("confined", "") if first else ""
        partly = not self.confined.startswith("Landlock") or "not confined" in self.confined
        if first and partly and not FunctionRunner._unconfined_said:
            FunctionRunner._unconfined_said = True  # once per process: each stage starts one worker per run
            print(
                f"kubealign: warning: reward functions run outside part of the sandbox: {self.confined}",
                file=sys.stderr,
            )
        for spec in self.specs:
            reply = self._ask({"op": "load", "spec": spec._asdict()}, spec, "loading it")
            if "error" in reply:
                raise UserError(f"{spec.field}: {reply['message']}")

    def restart(self) -> None:
        """A fresh worker with the same functions: nothing the user's code kept in its modules and classes, nor any
        file it wrote, carries over (evaluate starts one per model)."""
        self.close()
        self.start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.process is not None:
            with contextlib.suppress(OSError):  # /proc unreadable: the group below still goes
                sandbox.end_tree(self.process.pid)  # every descendant, detached ones included (subreaper)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        self._pending = b""
        if self._dumpable is not None:
            with contextlib.suppress(OSError, AttributeError):
                sandbox.restore_dumpable(self._dumpable)
            self._dumpable = None
        if self.output is not None:
            self._drain()
            self.output.close()
            self.output = None
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None

    def _verdict(self) -> str | None:
        """What the watch ended the worker's tree for (a limit it went past), if it did."""
        if self.watch is not None:
            self.watch.stop()  # it may be ending the tree right now: its verdict is whole once it has stopped
            return self.watch.verdict
        return None

    def _drain(self) -> None:
        """Forward what the worker printed since the last call to the task's stderr, at most OUTPUT_LIMIT bytes
        (the last part, the only part read), then empty the file (the worker appends: its writes land at the new
        end)."""
        self.output.flush()
        size = os.fstat(self.output.fileno()).st_size
        self.output.seek(max(0, size - OUTPUT_LIMIT))
        printed = self.output.read(OUTPUT_LIMIT)
        self.output.truncate(0)
        if size > OUTPUT_LIMIT and not self.cut_said:
            self.cut_said = True
            print(
                f"kubealign: reward functions printed {size} bytes in one call; only the last "
                f"{OUTPUT_LIMIT} of each call are kept",
                file=sys.stderr,
            )
        if printed:
            sys.stderr.write(printed.decode(errors="replace"))
            sys.stderr.flush()

    def _ask(self, request: dict[str, Any], spec: FunctionSpec, what: str, limit: int = REPLY_LIMIT) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin and self.process.stdout
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            raise UserError(f"{label(spec)}: {self._verdict() or 'its worker process died'} ({what})") from None
        reply = self._read_reply(spec, what, limit)
        if reply.get("memory"):  # the function's allocation failed at the limit
            raise UserError(
                f"{label(spec)}: ran out of its memory, rewards.memory_limit_mb {self.memory_limit_mb} ({what})"
            )
        return reply

    def _read_reply(self, spec: FunctionSpec | None, what: str, limit: int = REPLY_LIMIT) -> dict[str, Any]:
        """The worker's next reply line, read within rewards.timeout_s in all: half a line written by the
        function is a timeout, not a hang; a line over `limit` bytes or not JSON is one line too."""
        assert self.process is not None and self.process.stdout
        name = label(spec) if spec else "the reward-function worker"
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close()
                raise UserError(f"{name}: no answer within rewards.timeout_s {self.timeout_s:g} s ({what}); stopped")
            chunk = os.read(fd, 65536)
            if not chunk:
                self._drain()
                code = self.process.wait()
                if self._verdict():
                    raise UserError(f"{name}: {self._verdict()} ({what}); stopped")
                killed = " (killed: out of memory?)" if code == -signal.SIGKILL else ""
                raise UserError(f"{name}: its worker process exited with code {code}{killed} ({what})")
            self._pending += chunk
            if len(self._pending) > limit:
                self.close()
                raise UserError(f"{name}: a reply over {limit} bytes ({what}); stopped")
        line, _, self._pending = self._pending.partition(b"\n")
        self._drain()
        if self.watch is not None and self.watch.check() is not None:  # what the call left running counts too
            verdict = self._verdict()
            self.close()
            raise UserError(f"{name}: {verdict} ({what}); stopped")
        try:
            reply = json.loads(line)
        except ValueError:
            self.close()
            raise UserError(f"{name}: a reply that is not the worker's ({what}): {line[:80]!r}; stopped") from None
        if not isinstance(reply, dict):
            self.close()
            raise UserError(f"{name}: a reply that is not the worker's ({what}): {line[:80]!r}; stopped")
        return reply

    def call(
        self,
        spec: FunctionSpec,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        origins: list[str],
    ) -> Values:
        """One value (float or None) per completion, checked; UserError naming the function and the row."""
        request = {"op": "call", "name": spec.name, "prompts": prompts, "completions": completions, "columns": columns}
        what = f"a batch of {len(completions)} rows starting at {origins[0]}" if origins else "an empty batch"
        reply = self._ask(request, spec, what)
        if reply.get("error") == "raised" and len(completions) > 1:
            self._name_row(spec, prompts, completions, columns, origins)
        if reply.get("error") == "raised":  # one row: that row
            raise UserError(f"{label(spec)}: raised {reply['message']} on row {origins[0]}")
        if "error" in reply:
            row = f" for row {origins[reply['row']]}" if "row" in reply and reply["row"] < len(origins) else ""
            raise UserError(f"{label(spec)}: {reply['message']}{row}")
        values = reply["values"]
        if len(values) != len(completions):
            raise UserError(
                f"{label(spec)}: returned {len(values)} values for {len(completions)} completions "
                f"({what}); expected one per completion"
            )
        for i, value in enumerate(values):
            if isinstance(value, str) or (value is not None and not math.isfinite(value)):
                raise UserError(f"{label(spec)}: returned {value} for row {origins[i]}; a reward must be finite")
        return values

    def tool_calls(self, calls: list[dict[str, Any]], max_chars: int) -> list[tuple[str, bool]]:
        """(text, is_error) per call {name, arguments}, run in the worker in one request: a tool's result, or
        the error a raising tool, an unknown name or arguments that do not fit give (an observation), each at
        most max_chars characters (cut in the worker; a reply longer than that many can be stops the worker). A
        tool that hangs is stopped at rewards.timeout_s with the worker: a UserError naming the tools."""
        tools = [s for s in self.specs if s.kind == "tool"]
        if not calls:
            return []
        first = next((s for s in tools if s.name == calls[0]["name"]), tools[0])
        request = {"op": "tools", "calls": calls, "tools": [s.name for s in tools], "max_chars": max_chars}
        names = sorted({c["name"] for c in calls})
        limit = sized_reply(len(calls), max_chars)
        reply = self._ask(request, first, f"{len(calls)} calls of {', '.join(names)}", limit)
        if "error" in reply:
            raise UserError(f"{label(first)}: {reply['message']}")
        return [(r["result"], False) if "result" in r else (r["error"], True) for r in reply["results"]]

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (type hints and docstrings), in tools.functions' order."""
        tools = [s for s in self.specs if s.kind == "tool"]
        if not tools:
            return []
        reply = self._ask({"op": "schemas", "tools": [s.name for s in tools]}, tools[0], "reading the schemas")
        if "error" in reply:
            raise UserError(f"tools: {reply['message']}; a tool needs type hints and a docstring")
        return reply["schemas"]

    def environment(self, op: str, payload: dict[str, Any], origins: list[str]) -> dict[str, Any]:
        """reset (slots, rows) -> {observations} or step (slots, actions) -> {steps}; UserError naming the row.
        payload's max_chars: what an observation may hold (cut in the worker; the reply is bounded by it)."""
        spec = next(s for s in self.specs if s.kind == "environment")
        what, limit = f"{op} of {len(payload['slots'])} rows", sized_reply(len(payload["slots"]), payload["max_chars"])
        reply = self._ask({"op": op, "name": spec.name, **payload}, spec, what, limit)
        if "error" in reply:
            row = f" on row {origins[reply['row']]}" if reply.get("row", len(origins)) < len(origins) else ""
            raise UserError(f"{label(spec)}: {reply['message']}{row}")
        return reply

    def _name_row(
        self,
        spec: FunctionSpec,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        origins: list[str],
    ) -> None:
        """Retry the rows one at a time and raise for the first one the function raises on."""
        for i in range(len(completions)):
            one = {k: v[i : i + 1] for k, v in columns.items()}
            request = {
                "op": "call",
                "name": spec.name,
                "prompts": prompts[i : i + 1],
                "completions": completions[i : i + 1],
                "columns": one,
            }
            reply = self._ask(request, spec, f"row {origins[i]}")
            if reply.get("error") == "raised":
                raise UserError(f"{label(spec)}: raised {reply['message']} on row {origins[i]}")


def sized_reply(items: int, max_chars: int) -> int:
    """Bytes a reply of `items` texts of at most max_chars characters can take: JSON writes a character in up to
    12 bytes (an escaped surrogate pair), the error messages and the rest of the line fit in the margins."""
    return items * (12 * max_chars + 30_000) + 4096


def label(spec: FunctionSpec) -> str:
    what = {"tool": "tool", "environment": "environment"}.get(spec.kind, "reward function")
    return f"{what} {spec.name} ({spec.field})"
