"""A fresh clone must hold everything it needs and nothing that exists only on the machine it came from.

A tracked `.venv-tools -> /tmp/ckv` link once made `make test` fail on every new machine while CI on the
machine that had /tmp/ckv stayed green. These tests read what git tracks (the index), so they see what a
clone gets, not what happens to lie in this working tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PART = re.compile(r"(^|/)(\.venv[^/]*|venv|site-packages)(/|$)")
# absolute paths that name a particular machine's layout: temp dirs, home dirs, this workplace's root
MACHINE_PATH = re.compile(r"(/tmp/[A-Za-z]|/root/|/work/|/home/[a-z])")
# where naming such a path is the point: the Dockerfiles' in-image caches, the install step they run inside
# the image (its build context at /tmp/context), the test of that, and this very test
MACHINE_PATH_ALLOWED = {
    "images/train/Dockerfile",
    "images/cpu/Dockerfile",
    "images/serve/Dockerfile",
    "images/install.sh",
    "tests/cluster/test_images.py",
    "tests/test_repo_hygiene.py",
}

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)


def tracked(*args: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line]


def escaping_links(entries: list[str], root: Path) -> list[str]:
    """`git ls-files -s` lines of symbolic links (mode 120000) whose target lies outside `root`."""
    bad = []
    for entry in entries:
        meta, path = entry.split("\t", 1)
        if meta.split()[0] != "120000":
            continue
        target = os.readlink(root / path) if (root / path).is_symlink() else ""
        resolved = Path(os.path.normpath(root / Path(path).parent / target))
        if not target or Path(target).is_absolute() or not resolved.is_relative_to(root):
            bad.append(f"{path} -> {target or '?'}")
    return bad


def test_no_tracked_link_leaves_the_repository():
    assert escaping_links(tracked("-s"), ROOT) == []


def test_the_link_check_catches_a_link_to_tmp(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "tools").symlink_to("/tmp/ckv")
    (tmp_path / "up").symlink_to("../elsewhere")
    (tmp_path / "ok").symlink_to("inside")
    entries = [f"120000 abc 0\t{name}" for name in ("tools", "up", "ok")] + ["100644 def 0\tinside/file.py"]
    assert escaping_links(entries, tmp_path) == ["tools -> /tmp/ckv", "up -> ../elsewhere"]


def test_no_virtual_environment_is_tracked():
    assert [path for path in tracked() if VENV_PART.search(path)] == []
    assert VENV_PART.search(".venv-tools") and VENV_PART.search("a/lib/site-packages/x.py")
    assert not VENV_PART.search("kubealign/venvs.py")


def test_no_tracked_file_names_a_path_of_the_build_machine():
    found = []
    for path in tracked():
        file = ROOT / path
        if path in MACHINE_PATH_ALLOWED or file.is_symlink() or not file.is_file():
            continue
        text = file.read_bytes()
        if b"\0" in text[:4096]:
            continue  # binary
        for number, line in enumerate(text.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line) or str(ROOT) in line:
                found.append(f"{path}:{number}: {line.strip()[:100]}")
    assert found == []


def compile_errors(paths: list[str]) -> list[str]:
    """Each path whose Python does not compile (a SyntaxError that only compiling finds, such as a `global`
    after the name's first use, which neither ruff nor ast.parse reports), as 'path:line: message'."""
    found = []
    for path in paths:
        try:
            compile((ROOT / path).read_text(encoding="utf-8"), path, "exec")
        except SyntaxError as error:
            found.append(f"{path}:{error.lineno}: {error.msg}")
    return found


def test_every_tracked_python_file_compiles():
    # benchmarks/ and scripts are not imported by any test: a file there that does not compile is only
    # found by the person who runs it (benchmarks/real_lengths.py once did not)
    assert compile_errors([p for p in tracked() if p.endswith(".py")]) == []


def test_the_compile_check_catches_a_late_global(tmp_path, monkeypatch):
    bad = tmp_path / "late.py"
    bad.write_text("X = 1\n\n\ndef main():\n    print(X)\n    global X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert compile_errors(["late.py"]) == ["late.py:6: name 'X' is used prior to global declaration"]
