"""Where DeepSpeed's JIT-built ops go (kubealign.training.oplocks.environment_dir): one directory per Python
environment, unless the user names one, and one line on screen while the comm op is built, none once it is."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kubealign.training import oplocks

EXT = "TORCH_EXTENSIONS_DIR"
NOTICE = "building DeepSpeed's shm_comm op for this environment (once, about a minute) into"


def test_two_virtual_environments_get_two_directories_each_inside_its_own(tmp_path: Path):
    one, two = tmp_path / "clone" / ".venv", tmp_path / "checkout" / ".venv"
    one.mkdir(parents=True)
    two.mkdir(parents=True)
    base = str(tmp_path / "python")
    assert oplocks.environment_dir(str(one), base) == one / "torch-extensions"
    assert oplocks.environment_dir(str(two), base) == two / "torch-extensions"


def test_environments_that_are_not_writable_venvs_get_a_cache_directory_keyed_by_their_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    one = oplocks.environment_dir("/usr", "/usr")  # a system Python, an image's
    two = oplocks.environment_dir("/opt/conda", "/opt/conda")
    assert one != two
    assert one.parent == two.parent == tmp_path / "cache" / "kubealign" / "torch_extensions"
    assert oplocks.environment_dir("/usr", "/usr") == one  # the same environment: the same directory


def test_the_user_s_directory_is_kept_and_an_unset_one_is_set_for_this_process_and_its_children(tmp_path, monkeypatch):
    monkeypatch.setenv(EXT, str(tmp_path / "mine"))
    assert oplocks.use_environment_dir() == tmp_path / "mine"
    assert os.environ[EXT] == str(tmp_path / "mine")
    monkeypatch.delenv(EXT)
    assert oplocks.use_environment_dir() == oplocks.environment_dir(sys.prefix, sys.base_prefix)
    assert os.environ[EXT] == str(oplocks.environment_dir(sys.prefix, sys.base_prefix))


@pytest.fixture
def extensions(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(EXT, str(tmp_path / "ext"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return tmp_path / "ext"


def test_one_line_says_the_comm_op_is_being_built_when_it_is_not_built_yet(extensions: Path, capfd):
    with oplocks.guard(oplocks.COMM_OPS):
        pass  # where DeepSpeed would build it
    err = capfd.readouterr().err
    assert err.count(NOTICE) == 1 and f"{NOTICE} {extensions}" in err
    assert len(err.splitlines()) == 1


def test_nothing_is_said_when_the_comm_op_is_built_already(extensions: Path, capfd):
    built = extensions / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    with oplocks.guard(oplocks.COMM_OPS):
        pass
    with oplocks.guard():  # the optimizer's guard names no op: it says nothing either
        pass
    assert capfd.readouterr().err == ""


def test_only_the_first_local_rank_says_it(extensions: Path, capfd, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with oplocks.guard(oplocks.COMM_OPS):
        pass
    assert capfd.readouterr().err == ""
