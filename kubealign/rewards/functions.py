"""Run reward functions in a worker process (kubealign.rewards.worker) and check what they return.

Every failure is a UserError of one line naming the function (`reward function NAME
(rewards.functions[i])`) and, where it applies, the row (its data-split origin, FILE:LINE): a function
that cannot be loaded, has the wrong signature, raises, returns the wrong number of values, a value that
is not a number or None, or a non-finite one, or does not return within rewards.timeout_s (then the
worker is killed). When a batch call raises, the rows are retried one at a time to name the first row
that makes it raise.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
from typing import Any

from kubealign.errors import UserError
from kubealign.rewards.definitions import FunctionSpec

Values = list[float | None]


class FunctionRunner:
    """The worker process and the loaded functions; use as a context manager (the worker is ended on exit)."""

    def __init__(self, specs: list[FunctionSpec], timeout_s: float):
        self.specs, self.timeout_s = specs, timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> FunctionRunner:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kubealign.rewards.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for spec in self.specs:
            reply = self._ask({"op": "load", "spec": spec._asdict()}, spec, "loading it")
            if "error" in reply:
                raise UserError(f"{spec.field}: {reply['message']}")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

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
        if not line:
            code = self.process.wait()
            raise UserError(f"{label(spec)}: its worker process exited with code {code} ({what})")
        return json.loads(line)

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
