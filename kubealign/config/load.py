"""Load a YAML config (a file or a shipped preset), apply --set overrides, validate.

A file may hold only the sections and keys it changes; everything else takes its default.
Every failure is a UserError naming the file, line or field.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from kubealign.config.pipeline import deprecation
from kubealign.config.schema import KubealignConfig
from kubealign.errors import UserError

DEFAULT_PRESET = "tiny-cpu"
_SAID: set[str] = set()  # the deprecation lines printed by this process (each once)


def preset_names() -> list[str]:
    """Names of the presets shipped in configs/ (installed as kubealign.configs)."""
    files = resources.files("kubealign.configs")
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def _read_source(config: str | Path | None) -> tuple[str, str]:
    """Return (label, YAML text) for a path, a preset name, or None (the embedded default)."""
    if config is None:
        config = DEFAULT_PRESET
    path = Path(config)
    if path.is_file():
        try:
            return str(path), path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    if path.exists():
        raise UserError(f"--config {config}: is a directory, expected a YAML file")
    name = str(config).removesuffix(".yaml")
    if "/" not in name and name in preset_names():
        text = resources.files("kubealign.configs").joinpath(f"{name}.yaml").read_text(encoding="utf-8")
        return f"preset {name}", text
    raise UserError(f"--config {config}: no such file and no such preset (presets: {', '.join(preset_names())})")


def _parse_yaml(label: str, text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark else label
        problem = getattr(exc, "problem", None) or first_problem(exc)
        raise UserError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected a mapping of sections at the top, got {type(data).__name__}")
    return data


def first_problem(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `section.key=value` override in place; the value is parsed as a YAML scalar/list."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {override!r}: expected section.key=value")
    parts = key.strip().split(".")
    if len(parts) < 2 or any(not p for p in parts):
        raise UserError(f"--set {override!r}: the key must name a section and a field, like data.seed")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise UserError(f"--set {override!r}: value is not valid YAML: {first_problem(exc)}") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _format_validation(label: str, exc: ValidationError, overridden: set[str]) -> str:
    errors = exc.errors()
    err = errors[0]
    field = ".".join(str(p) for p in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    if not field:  # a rule across sections: its message names the fields
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"{label}: {message}{more}"
    if err["type"] == "extra_forbidden":
        message = "unknown field" + _did_you_mean(err["loc"])
    from_set = any(field == key or field.startswith(key + ".") or key.startswith(field + ".") for key in overridden)
    origin = " (from --set)" if from_set else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{label}: field '{field}'{origin}: {message}{more}"


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """' (did you mean 'X'?)' when a field of the unknown one's own section is a close spelling, else ""."""
    model: Any = KubealignConfig
    for part in loc[:-1]:  # down to the section: its fields' annotations (X, X | None, list[X])
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return ""
        kinds = [field.annotation, *get_args(field.annotation)]
        kinds += [arg for kind in kinds for arg in get_args(kind)]
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    close = difflib.get_close_matches(str(loc[-1]), list(getattr(model, "model_fields", {})), n=1, cutoff=0.75)
    return f" (did you mean '{close[0]}'?)" if close else ""


def load_config(config: str | Path | None = None, overrides: list[str] | None = None) -> KubealignConfig:
    """Resolve a config: file or preset (default: the tiny-cpu preset), then overrides, then validate."""
    label, text = _read_source(config)
    data = _parse_yaml(label, text)
    resolved = _validate(label, data, overrides)  # the overrides are applied to `data`
    _deprecated(data.get("pipeline"), resolved)
    # relative reward-function files are relative to the YAML file: a preset's to the installed presets
    if label.startswith("preset "):
        resolved._base_dir = str(Path(str(resources.files("kubealign.configs"))).resolve())
    else:
        resolved._base_dir = str(Path(label).resolve().parent)
    return resolved


def _deprecated(section: Any, config: KubealignConfig) -> None:
    """One line on stderr, once per process, for the deprecated spellings of pipeline.candidates in a user's
    config (a file, a preset, --set). Not in config_from_json, how each of the pipeline's tasks reads its
    config: that is a config already read (the DAG's config_json has the default pipeline section, a run's
    index its candidates), and a task would repeat the line."""
    line = deprecation(section if isinstance(section, dict) else None, config.routes())
    if line is None or line in _SAID or os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 says it
        return
    _SAID.add(line)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def config_to_json(config: KubealignConfig) -> str:
    """The resolved config as canonical JSON: the pipeline parameter `config_json` (stable text, so
    KFP cache keys built from it change only when the config does)."""
    return json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def config_from_json(text: str, overrides: list[str] | None = None) -> KubealignConfig:
    """Inverse of config_to_json, with --set style overrides (how a KFP task gets its config)."""
    label = "pipeline parameter config_json"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{label}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected a JSON object of sections, got {type(data).__name__}")
    return _validate(label, data, overrides)


def _validate(label: str, data: dict[str, Any], overrides: list[str] | None) -> KubealignConfig:
    overridden: set[str] = set()
    for override in overrides or []:
        apply_override(data, override)
        overridden.add(override.partition("=")[0].strip())
    try:
        return KubealignConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(_format_validation(label, exc, overridden)) from None


def config_to_yaml(config: KubealignConfig) -> str:
    """The resolved config as YAML, every field spelled out (what `kubealign config show` prints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def section_sha256(section: Any) -> str:
    """Content hash of a config section (canonical JSON), used in cache keys and manifests."""
    payload = json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def flatten(config: KubealignConfig) -> dict[str, str]:
    """Dotted-key view of the config for MLflow params (lists/None rendered as JSON)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", config.model_dump(mode="json"))
    return out
