"""Resolve a model name to something `from_pretrained` loads, and load tokenizer / causal LM.

`tiny-opt` / `tiny-llama` resolve to a locally built, cached tiny model. Any other name goes to
transformers' `from_pretrained` as it is: a local HF dir, or a hub id (downloaded by transformers when
the network allows it; HF_HUB_OFFLINE=1 makes it use the local HF cache only). trust_remote_code is
off unless the config turns it on, so a model repo cannot run its own code by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubealign.errors import UserError, first_line
from kubealign.models import tiny


def resolve(name: str) -> str:
    """The path or hub id that from_pretrained should get for `name`."""
    if name in tiny.TINY_NAMES:
        return str(tiny.ensure(tiny.TINY_NAMES[name]))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"model {name}: directory has no config.json (not a Hugging Face model dir)")
        return str(path)
    if name.startswith((".", "/", "~")):
        raise UserError(f"model {name}: no such directory")
    return name


def _load(kind: str, loader: Any, name: str, trust_remote_code: bool, **kwargs: Any) -> Any:
    target = resolve(name)
    try:
        return loader.from_pretrained(target, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as exc:  # OSError (not found / offline), ValueError (remote code), ...
        hint = ""
        if "trust_remote_code" in str(exc):
            hint = " (it ships its own code: set trust_remote_code: true only if you trust it)"
        raise UserError(f"model {name}: cannot load {kind}: {first_line(exc)}{hint}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def revision_kw(revision: str | None) -> dict[str, str]:
    """from_pretrained's `revision` for a hub model pinned to one (config: section.revision), else nothing."""
    return {"revision": revision} if revision else {}


def load_tokenizer(name: str, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    from transformers import AutoTokenizer

    target = Path(resolve(name))
    # transformers 5 builds an empty tokenizer (vocabulary of 1) for a dir without tokenizer files.
    if target.is_dir() and not any((target / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"model {name}: cannot load tokenizer: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    tokenizer = _load("tokenizer", AutoTokenizer, name, trust_remote_code, **revision_kw(revision))
    if len(tokenizer) < 2:
        raise UserError(f"model {name}: cannot load tokenizer: it has an empty vocabulary")
    return tokenizer


def load_causal_lm(name: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return _load("model", AutoModelForCausalLM, name, trust_remote_code, **kwargs)


HINTS = {"ForCausalLM": "the SFT stage's output", "ForSequenceClassification": "the reward stage's output"}


def model_dir_config(flag: str, path: str | Path, kind: str) -> dict[str, Any]:
    """The config.json of the model dir given as `flag`, checked to hold a *`kind` architecture
    (ForCausalLM: a policy; ForSequenceClassification: a reward model or critic). A causal LM given
    where a reward model belongs would otherwise load with a new, random score head and score nothing."""
    import json

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UserError(f"{flag} {path}: not a model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{flag} {path}: unreadable config.json: {first_line(exc)}") from None
    found = config.get("architectures") or ["an unknown architecture"]
    if not any(str(a).endswith(kind) for a in found):
        raise UserError(f"{flag} {path}: is {', '.join(map(str, found))}, expected a *{kind} model ({HINTS[kind]})")
    return config


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence a model's config says it takes (max_position_embeddings, GPT-2's
    n_positions); None when it names none."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def check_fits(fields: str, total: int, role: str, flag: str, config: dict[str, Any]) -> None:
    """Raise when `total` tokens (the sum the config fields in `fields` allow) exceed the positions of the
    model given as `flag`: its position table would be indexed past its end (an IndexError deep in
    generate or forward)."""
    limit = max_positions(config)
    if limit is not None and total > limit:
        raise UserError(f"{fields} = {total} exceeds the {role}'s max_position_embeddings {limit} ({flag})")


def torch_dtype(name: str) -> Any:
    """The torch dtype for a config dtype name (fp32 | bf16 | fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
