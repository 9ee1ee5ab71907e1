"""Every checkpoint carries a sha256 manifest and `--resume` verifies it first (issue 12, case 9): a
changed, missing or added file stops the resume with one line naming it; the checkpoint stays."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.training import checkpoints
from tests.test_training import kubealign_subprocess, split_dir  # noqa: F401  (split_dir is a fixture)

pytestmark = pytest.mark.faults


def fake_checkpoint(root: Path, tag: str = "step4") -> Path:
    (root / tag / "sub").mkdir(parents=True)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"\x00weights" * 100)
    (root / tag / "sub" / "optim.pt").write_bytes(b"\x01optimizer" * 50)
    (root / "latest").write_text(tag)
    return root / tag


def test_seal_then_verify_accepts_the_checkpoint_as_saved(tmp_path: Path):
    tag_dir = fake_checkpoint(tmp_path)
    checkpoints.seal(tmp_path, "step4")
    manifest = json.loads((tag_dir / checkpoints.MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["mp_rank_00_model_states.pt", "sub/optim.pt"]
    assert manifest["files"]["sub/optim.pt"] == checkpoints.file_sha256(tag_dir / "sub" / "optim.pt")
    checkpoints.verify(tmp_path)  # unchanged: no error


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "sub" / "optim.pt").write_bytes(b"\x01optimizes" + b"\x01optimizer" * 49),
            "optim.pt does not match",
        ),
        (lambda d: (d / "mp_rank_00_model_states.pt").unlink(), "mp_rank_00_model_states.pt is missing"),
        (
            lambda d: (d / "zero_pp_rank_1_optim_states.pt").write_bytes(b"x"),
            "zero_pp_rank_1_optim_states.pt is not in",
        ),
    ],
    ids=["one-byte-changed", "file-missing", "file-added"],
)
def test_verify_names_the_damaged_file(tmp_path: Path, damage, message: str):
    tag_dir = fake_checkpoint(tmp_path)
    checkpoints.seal(tmp_path, "step4")
    damage(tag_dir)
    with pytest.raises(UserError, match=message):
        checkpoints.verify(tmp_path)


def test_verify_checks_the_tag_latest_names(tmp_path: Path):
    old = fake_checkpoint(tmp_path, "step2")
    checkpoints.seal(tmp_path, "step2")
    new = fake_checkpoint(tmp_path, "step4")
    checkpoints.seal(tmp_path, "step4")
    (old / "sub" / "optim.pt").write_bytes(b"older checkpoint, not the one resumed")
    checkpoints.verify(tmp_path)
    (new / "sub" / "optim.pt").write_bytes(b"changed")
    with pytest.raises(UserError, match="step4/sub/optim.pt"):
        checkpoints.verify(tmp_path)


def test_a_checkpoint_without_manifest_loads_with_a_warning(tmp_path: Path, caplog):
    fake_checkpoint(tmp_path)
    with caplog.at_level(logging.WARNING):
        checkpoints.verify(tmp_path)
    assert "has no kubealign-sha256.json; loading it unverified" in caplog.text


def test_resume_from_a_tampered_checkpoint_is_refused_and_the_checkpoint_kept(split_dir: Path, tmp_path: Path):  # noqa: F811
    common = ["--data", split_dir, "--set", "tracking.enabled=false", "--set", "sft.num_train_epochs=0.3",
              "--set", "sft.save_every_steps=2"]  # fmt: skip
    killed = kubealign_subprocess("sft", *common, "--output", tmp_path / "run", env={"KUBEALIGN_FAULT_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    saved = tmp_path / "run.checkpoints"
    tag_dir = saved / (saved / "latest").read_text().strip()
    manifest = json.loads((tag_dir / checkpoints.MANIFEST).read_text())
    assert any(name.endswith("model_states.pt") for name in manifest["files"])
    shutil.copytree(saved, tmp_path / "copy.checkpoints")
    states = next(p for p in tag_dir.rglob("*model_states.pt"))
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))
    resumed = kubealign_subprocess("sft", *common, "--resume", "--output", tmp_path / "run")
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    last = resumed.stderr.strip().splitlines()[-1]
    assert last.startswith("kubealign: error: --resume:") and states.name in last and "Traceback" not in resumed.stderr
    assert states.read_bytes() == bytes(data)  # the checkpoint is kept for inspection
    assert not (tmp_path / "run").exists()
    # The intact copy resumes.
    good = kubealign_subprocess("sft", *common, "--resume", "--output", tmp_path / "copy")
    assert good.returncode == 0, good.stderr[-2000:]
