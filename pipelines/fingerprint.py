"""Content fingerprints that go into KFP cache keys, computed where the pipeline is compiled.

KFP reuses a task when its inputs are equal. A data source named by path would therefore be "equal"
after its file changed; so the compiled pipeline carries the sources' content hash (the same one the
data-split manifest records) as an input of data_split, and the base models' hashes as inputs of sft
and reward. Downstream tasks take upstream artifacts, so a changed input invalidates everything after
it and nothing before it.

The user's benchmark suites (evaluate.suites.include_path) are pinned the same way, as a constant input of
evaluate (`suites_fingerprint`): their files' sha256, which the task checks against the files it reads.

What cannot be hashed from here (a hub dataset or model id, a path that exists only in the cluster) is
fingerprinted by its name: pin a revision in the name or a dataset version if that matters.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kubealign import __version__
from kubealign.config import KubealignConfig, section_sha256
from kubealign.outputs import tree_sha256


def data_fingerprint(config: KubealignConfig) -> str:
    from kubealign.data.sources import BUILT_IN, read_source

    parts = [section_sha256(config.data)]
    for index, source in enumerate(config.data.sources):
        if source.path in BUILT_IN or Path(source.path).exists():
            parts.append(read_source(index, source, config.data).sha256)
        else:
            parts.append(f"name:{source.path}:{source.name}:{source.split}")
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def model_fingerprint(name: str, revision: str | None = None) -> str:
    """A local model dir by content; a built-in tiny model by name and code version; a hub model by the
    commit it was pinned to (kubealign.models.hub.pin); else by name."""
    if Path(name).is_dir():
        return tree_sha256(Path(name))
    if name.startswith("tiny-"):  # built from config by this version of kubealign
        return f"{name}@kubealign-{__version__}"
    return f"hub:{name}@{revision}" if revision else f"name:{name}"


def suites_fingerprint(config: KubealignConfig) -> str:
    """evaluate.suites' include_path files and allow_code (kubealign.answers.suites.fingerprint); "" when no suite
    reads anything of the user's. A directory holding Python without allow_code is refused here already."""
    from kubealign.answers import suites

    return suites.fingerprint(config.evaluate.suites, config.base_dir)
