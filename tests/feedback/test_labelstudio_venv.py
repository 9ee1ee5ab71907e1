"""Where `make test-labelstudio`'s Label Studio venv is looked for: an absolute path whatever the working
directory, since the server starts in a temporary directory (the relative path the Makefile once passed was
not found there)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.feedback.test_labelstudio import REPO, VENV_ENV, venv_path


def test_a_relative_venv_resolves_against_the_repository_not_the_working_directory(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert venv_path(".venv-labelstudio") == REPO / ".venv-labelstudio"
    assert venv_path(None) == REPO / ".venv-labelstudio"
    assert venv_path(str(tmp_path / "ls")) == tmp_path / "ls"
    assert venv_path(".venv-labelstudio").is_absolute()


def test_the_makefile_passes_the_venv_as_an_absolute_path(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    shown = subprocess.run(
        ["make", "-n", "-C", str(REPO), "test-labelstudio"],  # -n: prints the recipes, runs nothing
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    [line] = [word for word in shown.stdout.split() if word.startswith(f"{VENV_ENV}=")]
    assert line == f"{VENV_ENV}={REPO / '.venv-labelstudio'}"
