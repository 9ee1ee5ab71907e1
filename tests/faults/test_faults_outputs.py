"""Outputs never cost the user a file: --output onto a directory kubealign did not write is refused,
an unwritable location is one line, and two writers swapping the same output at once leave one whole
output and no temporary directory (issue 12, cases 1 and 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.outputs import atomic_dir, check_output_path

pytestmark = pytest.mark.faults


def notes_dir(tmp_path: Path) -> Path:
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "todo.txt").write_text("mine\n")
    (notes / "sub" / "draft.md").write_text("also mine\n")
    return notes


def tree(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): p.read_text() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_directory_of_the_users_files_is_refused_and_kept(cli, tmp_path: Path):
    notes = notes_dir(tmp_path)
    before = tree(notes)
    result = cli("tiny-model", "--arch", "opt", "--output", notes)
    assert result.code == 2
    assert result.err.count("\n") == 1 and "is not a kubealign tiny-model output" in result.err
    assert "Traceback" not in result.err
    assert tree(notes) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no temporary directory either


def test_output_dot_is_refused_without_touching_the_working_directory(cli, tmp_path: Path, monkeypatch):
    work = notes_dir(tmp_path)
    monkeypatch.chdir(work)
    before = tree(work)
    result = cli("tiny-model", "--arch", "opt", "--output", ".")
    assert result.code == 2 and "not a kubealign tiny-model output" in result.err
    assert tree(work) == before


def test_another_stages_output_is_refused(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text(json.dumps({"stage": "sft", "metrics": {}, "outputs": {}}))
    with pytest.raises(UserError, match="holds a 'sft' output, not a 'reward' one"):
        check_output_path(out, "reward")
    check_output_path(out, "sft")  # the same stage: replacing it is the default
    empty = tmp_path / "empty"
    empty.mkdir()
    check_output_path(empty, "sft")


def test_a_previous_output_of_the_same_stage_is_replaced(cli, tmp_path: Path):
    out = tmp_path / "tiny"
    assert cli("tiny-model", "--arch", "opt", "--output", out, "--seed", "1").code == 0
    (out / "stale.txt").write_text("written by the previous run's owner? no: inside a kubealign output")
    first = (out / "model.safetensors").read_bytes()
    result = cli("tiny-model", "--arch", "opt", "--output", out, "--seed", "2")
    assert result.code == 0, result.err
    assert not (out / "stale.txt").exists()  # replaced as a whole, not merged
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "result.json").read_text())["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def unwritable_location(tmp_path: Path) -> Path:
    """A path whose missing parent cannot be created: a read-only directory, or /sys as root (root
    writes through permission bits)."""
    if os.geteuid() == 0:
        return Path("/sys/kubealign-test-unwritable/a/out")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return locked / "a" / "out"


def test_an_unwritable_location_is_one_line_and_leaves_nothing(cli, tmp_path: Path):
    out = unwritable_location(tmp_path)
    result = cli("tiny-model", "--arch", "opt", "--output", out)
    assert result.code == 2, result.err
    assert result.err.startswith("kubealign: error: --output") and result.err.count("\n") == 1
    assert not out.parent.exists()


def test_atomic_dir_error_inside_leaves_the_previous_output_whole(tmp_path: Path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (tmp / "result.json").write_text(json.dumps({"stage": "x"}))
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed halfway")
    assert (final / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_foreign_directory_appearing_at_swap_time_is_left_untouched(tmp_path: Path):
    final = tmp_path / "out"
    with pytest.raises(UserError, match="did not write; left untouched"), atomic_dir(final) as tmp:
        (tmp / "result.json").write_text(json.dumps({"stage": "x"}))
        final.mkdir()
        (final / "mine.txt").write_text("user file")
    assert (final / "mine.txt").read_text() == "user file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


WRITER = """
import json, sys, time
from pathlib import Path
from kubealign.errors import UserError
from kubealign.outputs import atomic_dir
final, name, start = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
while time.time() < start:
    pass
try:
    with atomic_dir(final) as tmp:
        for i in range(20):
            (tmp / f"f{i}").write_text(name)
        (tmp / "result.json").write_text(json.dumps({"stage": "s", "writer": name}))
except UserError as exc:
    print(f"kubealign: error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def test_two_writers_at_once_leave_one_whole_output_and_no_temp_dir(tmp_path: Path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "root"
    root.mkdir()
    final = root / "out"
    losers = 0
    for attempt in range(30):
        start = time.time() + 0.4  # both spin until the same instant, past their imports
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(final), name, str(start)], stderr=subprocess.PIPE, text=True
            )
            for name in (f"a{attempt}", f"b{attempt}")
        ]
        outcomes = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
        for code, err in outcomes:
            assert code in (0, 2), err
            if code == 2:
                losers += 1
                assert err.count("\n") == 1 and "at the same time; its output is kept" in err, err
        assert any(code == 0 for code, _ in outcomes)
        writer = json.loads((final / "result.json").read_text())["writer"]
        assert writer in (f"a{attempt}", f"b{attempt}")
        assert {(final / f"f{i}").read_text() for i in range(20)} == {writer}  # whole, not mixed
        assert sorted(p.name for p in root.iterdir()) == ["out"]
    print(f"{losers} of 30 tries had a loser")


def test_a_data_split_cache_hit_verifies_the_phase_files(cli, tmp_path: Path, caplog):
    """A phase file changed after the split (a row swapped in the arrow data) is not reused."""
    from datasets import load_from_disk

    from tests.conftest import pairs, write_jsonl

    src = write_jsonl(tmp_path / "d.jsonl", pairs(60))
    out = tmp_path / "out"
    assert cli("data-split", "--source", src, "--set", "tracking.enabled=false", "--output", out).code == 0
    assert "cache hit" in cli("data-split", "--source", src, "--set", "tracking.enabled=false", "--output", out).out
    # Poison one phase the way an attacker or a bad copy would: same layout, other content.
    phase = out / "phase1_sft"
    poisoned = load_from_disk(str(phase))
    poisoned = poisoned.map(lambda row: {"chosen": " POISON"})
    poisoned.save_to_disk(str(tmp_path / "poisoned"))
    for arrow in (tmp_path / "poisoned").rglob("data-*.arrow"):
        (phase / arrow.relative_to(tmp_path / "poisoned")).write_bytes(arrow.read_bytes())
    result = cli("data-split", "--source", src, "--set", "tracking.enabled=false", "--output", out)
    assert result.code == 0, result.err
    assert "computed" in result.out and "does not match its manifest's sha256" in caplog.text
    chosen = [c for split in load_from_disk(str(phase)).values() for c in split["chosen"]]
    assert " POISON" not in chosen and len(chosen) > 0
