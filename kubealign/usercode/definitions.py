"""Resolve `rewards.functions` (and the `tools` section's tools and environment) into FunctionSpecs: name,
weight, kind and where the code is.

A FILE.py:NAME function is read here, where the config is (a relative FILE is relative to the config
file), and its source text travels in the spec: the compiled pipeline embeds it, the task runs it from
there (not from the image), and its sha256 is part of the cache key of the tasks that score with it. A
module:NAME function is imported where it runs; the spec holds its module's source hash when the module
is importable here, so editing an installed module changes the key too. Nothing is ever loaded from the
artifact store or the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import NamedTuple

from kubealign.config.schema import RewardsConfig
from kubealign.config.tools import ToolsConfig
from kubealign.errors import UserError


class FunctionSpec(NamedTuple):
    index: int  # position in rewards.functions (errors name rewards.functions[index])
    name: str  # the function's name: metrics fn/<name>/...
    path: str  # as configured: FILE.py:NAME or module:NAME
    weight: float
    source: str | None  # a FILE.py function's source text; None for module:NAME
    sha256: str  # of the source text, or of the module's file when it was found here ('' if not)
    kind: str = "reward"  # reward: rewards.functions; tool: tools.functions; environment: tools.environment

    @property
    def field(self) -> str:
        if self.kind == "environment":
            return "tools.environment"
        section = "tools" if self.kind == "tool" else "rewards"
        return f"{section}.functions[{self.index}].path"

    @property
    def filename(self) -> str:
        """What tracebacks and errors call the code: the file as configured."""
        return self.path.rpartition(":")[0]


def is_file_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _module_sha256(module: str) -> str:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    origin = getattr(spec, "origin", None) if spec else None
    if not origin or not Path(origin).is_file():
        return ""
    return hashlib.sha256(Path(origin).read_bytes()).hexdigest()


def _code(where: str, field: str, base_dir: str | None) -> tuple[str | None, str]:
    """(source, sha256) of FILE.py (read here; UserError naming the field for a missing or unreadable one), or
    (None, the module file's sha256) of an importable module."""
    if not is_file_path(where):
        return None, _module_sha256(where)
    path = Path(where).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        relative = f" (relative to {base_dir})" if base_dir and not Path(where).is_absolute() else ""
        raise UserError(f"{field}: no such file: {where}{relative}")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{field}: cannot read {where}: {exc}") from None
    return source, hashlib.sha256(source.encode()).hexdigest()


def resolve(rewards: RewardsConfig, base_dir: str | None) -> list[FunctionSpec]:
    """The configured functions, their files read (UserError naming the field for a missing or unreadable one)."""
    specs = []
    for index, function in enumerate(rewards.functions):
        source, sha = _code(function.path.rpartition(":")[0], f"rewards.functions[{index}].path", base_dir)
        specs.append(FunctionSpec(index, function.name, function.path, function.weight, source, sha))
    return specs


def resolve_tools(tools: ToolsConfig, base_dir: str | None) -> list[FunctionSpec]:
    """The tools section's functions (kind tool) and environment (kind environment), their files read."""
    specs = []
    for index, function in enumerate(tools.functions):
        source, sha = _code(function.path.rpartition(":")[0], f"tools.functions[{index}].path", base_dir)
        specs.append(FunctionSpec(index, function.name, function.path, 0.0, source, sha, "tool"))
    if tools.environment is not None:
        where, _, name = tools.environment.rpartition(":")
        source, sha = _code(where, "tools.environment", base_dir)
        specs.append(FunctionSpec(0, name, tools.environment, 0.0, source, sha, "environment"))
    return specs


def resolve_all(rewards: RewardsConfig, tools: ToolsConfig, base_dir: str | None) -> list[FunctionSpec]:
    """Every piece of the user's code a run executes: the reward functions, then the tools and environment.
    They travel together (the pipeline parameter reward_functions) and are pinned together."""
    return resolve(rewards, base_dir) + resolve_tools(tools, base_dir)


def to_json(specs: list[FunctionSpec]) -> str:
    """Canonical JSON of the specs (a pipeline parameter: the same functions give the same text)."""
    return json.dumps([s._asdict() for s in specs], sort_keys=True, separators=(",", ":"))


def from_json(text: str) -> list[FunctionSpec]:
    label = "pipeline parameter reward_functions"
    try:
        items = json.loads(text) if text.strip() else []
        return [FunctionSpec(**item) for item in items]
    except (json.JSONDecodeError, TypeError) as exc:
        raise UserError(f"{label}: not a list of reward function specs ({exc})") from None


def check_matches(specs: list[FunctionSpec], rewards: RewardsConfig, tools: ToolsConfig | None = None) -> None:
    """The specs a task was handed are the config's functions (same paths and weights, in order), and its
    tools and environment when `tools` is given."""
    configured = [(f.path, f.weight, "reward") for f in rewards.functions]
    if tools is not None:
        configured += [(f.path, 0.0, "tool") for f in tools.functions]
        configured += [(tools.environment, 0.0, "environment")] if tools.environment is not None else []
    handed = [(s.path, s.weight, s.kind) for s in specs if tools is not None or s.kind == "reward"]
    if handed != configured:
        raise UserError(
            "pipeline parameter reward_functions does not match rewards.functions and tools in config_json "
            f"({[s[0] for s in handed]} vs {[p for p, _, _ in configured]}): compile the pipeline again"
        )


def fingerprint(specs: list[FunctionSpec]) -> str:
    """sha256 over the functions' paths, weights and code: the part of a cache key they make."""
    return hashlib.sha256(to_json(specs).encode()).hexdigest()
