"""The package installs as one `kubealign` namespace, with components/pipelines/configs mapped into it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_mapped_packages_import_from_outside_the_repo(tmp_path: Path):
    code = (
        "import importlib.util, kubealign.components as c, kubealign.pipelines as p, kubealign.configs as k\n"
        "print(c.__file__); print(p.__file__); print(k.__file__)\n"
        "print(importlib.util.find_spec('components'), importlib.util.find_spec('pipelines'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == str(REPO / "components" / "__init__.py")
    assert lines[1] == str(REPO / "pipelines" / "__init__.py")
    assert lines[2] == str(REPO / "configs" / "__init__.py")
    assert lines[3] == "None None"  # no generic top-level names leak out of the install


@pytest.mark.integration
def test_wheel_holds_only_the_kubealign_namespace(tmp_path: Path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kubealign-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kubealign", "kubealign-0.1.0.dist-info"}
    assert "kubealign/components/__init__.py" in names
    assert "kubealign/pipelines/__init__.py" in names
    assert "kubealign/configs/tiny-cpu.yaml" in names
    assert "kubealign/configs/rewards/arithmetic.py" in names  # a preset's reward function travels with it


def test_console_script_lists_every_stage():
    out = subprocess.run([Path(sys.executable).parent / "kubealign", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("data-split", "tiny-model", "config"):
        assert command in out.stdout


def test_every_package_of_the_library_is_installed():
    """A package missing from pyproject's list installs nowhere: the wheel and the images lack it (an
    editable install in the repo hides that)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "kubealign").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
