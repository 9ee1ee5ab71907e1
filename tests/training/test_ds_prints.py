"""DeepSpeed's bare print() lines (training.ds_prints): its two known notices dropped around its calls, every
other line kept whole and in order, all of them shown with KUBEALIGN_VERBOSE=1."""

from __future__ import annotations

import pytest

from kubealign.training import ds_prints

pytestmark = pytest.mark.unit


def noisy() -> None:
    print("before")
    print("DeepSpeed deepspeed_shm_comm built successfully")
    print("Using fallback functions in workspace because of 'module' has no attribute", end="")
    print("\nmid", end="")
    print("dle line")
    print("last, unfinished", end="")


def test_the_known_notices_are_dropped_and_every_other_line_kept(capsys, monkeypatch):
    monkeypatch.delenv(ds_prints.VERBOSE_ENV, raising=False)
    with ds_prints.quiet():
        noisy()
    assert capsys.readouterr().out == "before\nmiddle line\nlast, unfinished"


def test_verbose_shows_them_all(capsys, monkeypatch):
    monkeypatch.setenv(ds_prints.VERBOSE_ENV, "1")
    with ds_prints.quiet():
        noisy()
    out = capsys.readouterr().out
    assert "built successfully" in out and "Using fallback functions" in out


def test_a_stage_command_started_with_v_tells_its_children_to_be_verbose(monkeypatch):
    from kubealign.cli.training import quiet_libraries

    monkeypatch.setenv(ds_prints.VERBOSE_ENV, "0")  # put back as it was after the test
    quiet_libraries(True)
    import os

    assert os.environ[ds_prints.VERBOSE_ENV] == "1"
