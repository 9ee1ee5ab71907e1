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


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    target = Path(resolve(name))
    # transformers 5 builds an empty tokenizer (vocabulary of 1) for a dir without tokenizer files.
    if target.is_dir() and not any((target / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"model {name}: cannot load tokenizer: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    tokenizer = _load("tokenizer", AutoTokenizer, name, trust_remote_code)
    if len(tokenizer) < 2:
        raise UserError(f"model {name}: cannot load tokenizer: it has an empty vocabulary")
    return tokenizer


def load_causal_lm(name: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return _load("model", AutoModelForCausalLM, name, trust_remote_code, **kwargs)


def torch_dtype(name: str) -> Any:
    """The torch dtype for a config dtype name (fp32 | bf16 | fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
