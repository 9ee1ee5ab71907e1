"""Where kubealign keeps what it builds or downloads once and reuses: $KUBEALIGN_CACHE_DIR, default
~/.cache/kubealign. The tiny models (models/tiny), kfp.local's cache (pipelines/local), the serve venv, the
served versions and the canary fronts' tokens (serving/) live under it; a container gets one of its own (the
docker runner sets CACHE_ENV, containers/runner)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KUBEALIGN_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "kubealign"))
