"""Run reward functions in a worker process (kubealign.rewards.worker) and check what they return.

Every failure is a UserError of one line naming the function (`reward function NAME
(rewards.functions[i])`) and, where it applies, the row (its data-split origin, FILE:LINE): a function
that cannot be loaded, has the wrong signature, raises, returns the wrong number of values, a value that
is not a number or None, or a non-finite one, or does not return within rewards.timeout_s (then the
worker is killed). When a batch call raises, the rows are retried one at a time to name the first row
that makes it raise.

The worker's limits (user code runs there, not in the trainer): an environment with none of the task's
variables but PATH, LANG, LC_*, TZ, PYTHONPATH and those rewards.worker_env names (so no MLflow or object-store
credentials); a private working and temporary directory, removed at the end (a relative path a function
writes lands there, not in a stage's output; absolute paths are the task's file-system permissions, which
only the container bounds); rewards.memory_limit_mb of address space, past which its allocation fails and
the call is one line, with the worker first in line for the OOM killer; a process group of its own, killed
whole on a timeout or at the end; and what it prints, forwarded to the task's log at most OUTPUT_LIMIT
bytes per call (the last part kept, the cut said once).
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
from pathlib import Path
from typing import Any

from kubealign.errors import UserError
from kubealign.rewards.definitions import FunctionSpec
from kubealign.rewards.worker import MEMORY_ENV

Values = list[float | None]
KEPT_ENV = ("PATH", "LANG", "TZ", "PYTHONPATH")  # and LC_*: what a Python function may need, no credential
OUTPUT_LIMIT = 64 * 1024  # bytes of a call's printed output forwarded to the task's log
DEFAULT_MEMORY_MB = 4096


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

    def __init__(
        self,
        specs: list[FunctionSpec],
        timeout_s: float,
        memory_limit_mb: int = DEFAULT_MEMORY_MB,
        passed_env: list[str] | None = None,
    ):
        self.specs, self.timeout_s = specs, timeout_s
        self.memory_limit_mb, self.passed_env = memory_limit_mb, list(passed_env or [])
        self.process: subprocess.Popen | None = None
        self.home: Path | None = None
        self.output: Any = None  # the worker's stderr: a file in its private dir, drained after every call
        self.cut_said = False

    def __enter__(self) -> FunctionRunner:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="kubealign-reward-fn-"))
        self.output = open(self.home / ".output", "ab+")  # noqa: SIM115 - closed in close()
        env = worker_env(dict(os.environ), self.passed_env, self.home, os.getcwd())
        env[MEMORY_ENV] = str(self.memory_limit_mb)  # the worker limits itself before it loads any user code
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kubealign.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.output,
            text=True,
            env=env,
            cwd=self.home,
            start_new_session=True,  # its own process group: killed whole, children included
        )
        for spec in self.specs:
            reply = self._ask({"op": "load", "spec": spec._asdict()}, spec, "loading it")
            if "error" in reply:
                raise UserError(f"{spec.field}: {reply['message']}")

    def close(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # the group: whatever the function started goes too
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None
        if self.output is not None:
            self._drain()
            self.output.close()
            self.output = None
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None

    def _drain(self) -> None:
        """Forward what the worker printed since the last call to the task's stderr, at most OUTPUT_LIMIT bytes
        (the last part), then empty the file (the worker appends: its writes land at the new end)."""
        self.output.flush()
        self.output.seek(0)
        printed = self.output.read()
        self.output.truncate(0)
        if len(printed) > OUTPUT_LIMIT:
            if not self.cut_said:
                self.cut_said = True
                print(
                    f"kubealign: reward functions printed {len(printed)} bytes in one call; only the last "
                    f"{OUTPUT_LIMIT} of each call are kept",
                    file=sys.stderr,
                )
            printed = printed[-OUTPUT_LIMIT:]
        if printed:
            sys.stderr.write(printed.decode(errors="replace"))
            sys.stderr.flush()

    def _ask(self, request: dict[str, Any], spec: FunctionSpec, what: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin and self.process.stdout
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise UserError(f"{label(spec)}: its worker process died ({what})") from None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout_s)
        if not ready:
            self.close()
            raise UserError(f"{label(spec)}: no answer within rewards.timeout_s {self.timeout_s:g} s ({what}); stopped")
        line = self.process.stdout.readline()
        self._drain()
        if not line:
            code = self.process.wait()
            killed = " (killed: out of memory?)" if code == -signal.SIGKILL else ""
            raise UserError(f"{label(spec)}: its worker process exited with code {code}{killed} ({what})")
        reply = json.loads(line)
        if reply.get("memory"):  # the function's allocation failed at the limit
            raise UserError(
                f"{label(spec)}: ran out of its memory, rewards.memory_limit_mb {self.memory_limit_mb} ({what})"
            )
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


def label(spec: FunctionSpec) -> str:
    return f"reward function {spec.name} ({spec.field})"
