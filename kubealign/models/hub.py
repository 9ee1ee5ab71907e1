"""Hub models pinned to a commit when a pipeline is compiled.

A hub name alone is a moving target: a force-pushed repo changes what trains without changing any cache key.
When the DAG is built, each hub model it loads (sft.model, reward.model: dpo and ppo start from the SFT
output) resolves to the commit its `revision` (a branch or tag; default main) names: the hub's API answers
(HfApi.model_info, at HF_ENDPOINT), or offline (HF_HUB_OFFLINE) the local cache's refs. The compiled config
carries that commit as the section's `revision`, every task loads exactly it (from_pretrained(revision=)),
and the commit is the model's fingerprint in the cache key. A revision that is already a commit is kept
as it is, with no look-up: the way to compile where neither the hub nor a cache is at hand.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kubealign.config import KubealignConfig
from kubealign.errors import UserError, first_line
from kubealign.models import tiny

COMMIT = re.compile(r"[0-9a-f]{40}")
SECTIONS = ("sft", "reward")  # the hub models the DAG itself loads


def is_hub_name(name: str) -> bool:
    """Not a built-in tiny model and not a local path: a hub repo id."""
    if name in tiny.TINY_NAMES or name.startswith((".", "/", "~")):
        return False
    return not Path(name).expanduser().exists()


def commit_of(name: str, revision: str | None, field: str) -> str:
    """The commit `revision` (default main) of the hub model `name` names; UserError naming FIELD if unknown."""
    if revision and COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return _cached_commit(name, revision or "main", field)
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).model_info(name, revision=revision).sha
    except Exception as exc:  # not found, no network, a private repo without a token ...
        raise UserError(
            f"{field} {name}@{revision or 'main'}: cannot resolve it to a commit ({first_line(exc)}); set "
            f"{field.rpartition('.')[0]}.revision to a commit sha to compile without the hub"
        ) from None


def _cached_commit(name: str, ref: str, field: str) -> str:
    from huggingface_hub import constants

    refs = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "refs" / ref
    if refs.is_file():
        return refs.read_text(encoding="utf-8").strip()
    raise UserError(
        f"{field} {name}@{ref}: offline (HF_HUB_OFFLINE) and not in the local cache ({refs}); set "
        f"{field.rpartition('.')[0]}.revision to a commit sha"
    )


def pin(config: KubealignConfig) -> KubealignConfig:
    """`config` with each hub model of SECTIONS pinned to its commit (the section's `revision`)."""
    updates = {}
    for section in SECTIONS:
        cfg = getattr(config, section)
        if is_hub_name(cfg.model):
            commit = commit_of(cfg.model, cfg.revision, f"{section}.model")
            updates[section] = cfg.model_copy(update={"revision": commit})
    return config.model_copy(update=updates) if updates else config
