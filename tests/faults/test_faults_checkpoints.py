"""Every checkpoint carries a sha256 manifest and `--resume` verifies it first (issue 12, case 9): a
changed, missing or added file stops the resume with one line naming it; the checkpoint stays."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.training import checkpoints
from tests.stages.test_training import kubealign_subprocess, split_dir  # noqa: F401  (split_dir is a fixture)

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
    common = [
        "--data",
        split_dir,
        "--set",
        "tracking.enabled=false",
        "--set",
        "sft.num_train_epochs=0.3",
        "--set",
        "sft.save_every_steps=2",
    ]
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


# --- issue 35: `latest` moves only after every part is sealed; resume falls back to the newest sealed tag ------


def sealed_checkpoint(root: Path, tag: str) -> Path:
    tag_dir = fake_checkpoint(root, tag)
    checkpoints.seal(root, tag)
    return tag_dir


@pytest.mark.parametrize(
    ("latest", "why", "expected"),
    [
        ("", "is empty", "step4"),  # what DeepSpeed's truncate-then-write leaves when killed between the two
        (None, "is missing", "step4"),
        ("step6", "names step6, which is not there", "step4"),
        ("step8", "names step8, which was never sealed (the save was interrupted)", "step4"),
    ],
    ids=["empty", "missing", "dangling", "unsealed"],
)
def test_resume_falls_back_to_the_newest_sealed_tag_and_says_why(tmp_path: Path, caplog, latest, why, expected):
    sealed_checkpoint(tmp_path, "step2")
    sealed_checkpoint(tmp_path, "step4")
    (tmp_path / "step8").mkdir()  # a torn save: files, no manifest
    (tmp_path / "step8" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    if latest is None:
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_text(latest)
    with caplog.at_level(logging.WARNING):
        assert checkpoints.resume_tag(tmp_path) == expected
    assert f"{tmp_path / 'latest'} {why}; resuming from {expected}, the newest sealed checkpoint" in caplog.text


def test_resume_takes_the_sealed_tag_latest_names_and_refuses_it_changed(tmp_path: Path, caplog):
    sealed_checkpoint(tmp_path, "step2")
    sealed_checkpoint(tmp_path, "step4")
    (tmp_path / "latest").write_text("step2")  # not the newest: latest is what the run committed last
    with caplog.at_level(logging.WARNING):
        assert checkpoints.resume_tag(tmp_path) == "step2"
    assert caplog.text == ""
    (tmp_path / "step2" / "sub" / "optim.pt").write_bytes(b"changed")
    with pytest.raises(UserError, match="step2/sub/optim.pt does not match"):
        checkpoints.resume_tag(tmp_path)
    assert checkpoints.resume_tag(tmp_path / "nothing-here") is None


def test_a_step_is_resumed_only_from_an_iteration_every_part_sealed(tmp_path: Path):
    """PPO: the actor sealed iteration 2, the critic only iteration 1 (killed inside the critic's save)."""
    actor, critic = tmp_path / "actor", tmp_path / "critic"
    for part, tags in ((actor, ("iter1", "iter2")), (critic, ("iter1",))):
        for tag in tags:
            sealed_checkpoint(part, tag)
    (critic / "iter2").mkdir()
    assert checkpoints.sealed_tags([actor, critic]) == ["iter1"]
    assert checkpoints.sealed_tags([actor]) == ["iter2", "iter1"]
    assert checkpoints.resume_tag(tmp_path, [actor, critic]) == "iter1"
    (tmp_path / "latest").write_text("iter1")
    assert checkpoints.resume_tag(tmp_path, [actor, critic]) == "iter1"


def test_commit_replaces_latest_whole(tmp_path: Path):
    checkpoints.commit(tmp_path, "step2")
    checkpoints.commit(tmp_path, "step10")
    assert (tmp_path / "latest").read_text() == "step10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary file left


class SavingEngine:
    """A DeepSpeed engine's save_checkpoint: writes TAG/model_states.pt, or dies (the kill) when told to."""

    def __init__(self, dies: bool = False):
        self.dies = dies

    def save_checkpoint(self, save_dir, tag, client_state=None, save_latest=True):
        assert save_latest is False  # DeepSpeed's own latest is truncate-then-write, before the seal
        if self.dies:
            raise KeyboardInterrupt("killed inside the critic's save")
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "model_states.pt").write_bytes(tag.encode())


def test_ppo_moves_latest_only_after_the_actor_and_the_critic_are_sealed(tmp_path: Path):
    from types import SimpleNamespace

    from kubealign.rl.kl import KLController
    from kubealign.stages import ppo_state

    kl = KLController(0.1, None, 1)
    models = SimpleNamespace(actor=SavingEngine(), critic=SavingEngine())
    ppo_state.save_checkpoint(models, tmp_path, 1, kl, None, {})
    assert (tmp_path / "latest").read_text() == "iter1"
    models.critic.dies = True
    with pytest.raises(KeyboardInterrupt):
        ppo_state.save_checkpoint(models, tmp_path, 2, kl, None, {})
    assert (tmp_path / "latest").read_text() == "iter1"  # the actor's iteration 2 is on disk, not committed
    assert (tmp_path / "actor" / "iter2" / checkpoints.MANIFEST).exists() is False
    assert checkpoints.resume_tag(tmp_path, [tmp_path / "actor", tmp_path / "critic"]) == "iter1"


def test_an_empty_latest_left_by_a_killed_save_resumes_from_the_last_sealed_step(split_dir: Path, tmp_path: Path):  # noqa: F811
    """Before: an empty `latest` (DeepSpeed's truncate-then-write killed halfway) made every --resume die in a
    multi-line DeepSpeed assertion until someone edited the file by hand."""
    common = [
        "--data",
        split_dir,
        "--set",
        "tracking.enabled=false",
        "--set",
        "sft.num_train_epochs=0.3",
        "--set",
        "sft.save_every_steps=2",
    ]
    killed = kubealign_subprocess("sft", *common, "--output", tmp_path / "run", env={"KUBEALIGN_FAULT_AT_STEP": "3"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    saved = tmp_path / "run.checkpoints"
    assert (saved / "latest").read_text() == "step2"
    (saved / "latest").write_text("")
    resumed = kubealign_subprocess("sft", *common, "--resume", "--output", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{saved / 'latest'} is empty; resuming from step2, the newest sealed checkpoint" in resumed.stderr


# --- nothing of the user's is deleted; a fresh run never mixes with an earlier run's checkpoints --------------


def test_cleanup_removes_only_what_kubealign_wrote(tmp_path: Path):
    save = tmp_path / "out.checkpoints"
    for part in ("", "actor", "critic"):
        sealed_checkpoint(save / part if part else save, "iter1" if part else "step2")
    (save / "zero_to_fp32.py").write_text("# DeepSpeed's script")
    (save / "notes.txt").write_text("mine")
    (save / "actor" / "my-analysis").mkdir()
    checkpoints.remove(save)
    assert sorted(p.relative_to(save).as_posix() for p in save.rglob("*")) == [
        "actor",
        "actor/my-analysis",
        "notes.txt",
    ]
    (save / "notes.txt").unlink()
    (save / "actor" / "my-analysis").rmdir()
    sealed_checkpoint(save, "step4")
    checkpoints.remove(save)
    assert not save.exists()  # nothing else in it: the directory goes too


def test_a_fresh_run_refuses_a_foreign_or_stale_checkpoint_directory(tmp_path: Path):
    save = tmp_path / "x.checkpoints"
    assert checkpoints.checkpoint_dir(tmp_path / "x", resume=False) == save  # absent: fine
    save.mkdir()
    assert checkpoints.checkpoint_dir(tmp_path / "x", resume=False) == save  # empty: fine
    (save / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"x.checkpoints holds notes.txt, which kubealign did not write"):
        checkpoints.checkpoint_dir(tmp_path / "x", resume=False)
    (save / "notes.txt").unlink()
    sealed_checkpoint(save / "actor", "iter3")
    with pytest.raises(UserError, match=r"holds the checkpoints of an earlier run \(up to iter3\): pass --resume"):
        checkpoints.checkpoint_dir(tmp_path / "x", resume=False)
    assert checkpoints.checkpoint_dir(tmp_path / "x", resume=True) == save  # --resume takes them


def test_sft_leaves_a_user_file_in_its_checkpoint_directory_alone(split_dir: Path, tmp_path: Path):  # noqa: F811
    """Before: `kubealign sft --output X` removed X.checkpoints with rmtree at its end, notes.txt with it."""
    save = tmp_path / "run.checkpoints"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    common = ["--data", split_dir, "--set", "tracking.enabled=false", "--set", "sft.num_train_epochs=0.1"]
    refused = kubealign_subprocess("sft", *common, "--output", tmp_path / "run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"kubealign: error: {save} holds notes.txt, which kubealign did not write; the checkpoints of this output "
        "go there: move it, or choose another --output"
    )
    assert (save / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()


# --- a full disk while saving ------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 10 MiB tmpfs at tmp_path/run.checkpoints: room for one tiny-model sft checkpoint (7.2 MB), not two."""
    import subprocess

    mount = tmp_path / "run.checkpoints"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_while_saving_is_one_line_and_the_last_good_checkpoint_stays(
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    small_disk: Path,
):
    """Before: a 25-line traceback ending in torch's zip writer ("unexpected pos ..."), never "no space left",
    and the torn tag left behind, filling the disk further."""
    common = [
        "--data",
        split_dir,
        "--set",
        "tracking.enabled=false",
        "--set",
        "sft.num_train_epochs=0.3",
        "--set",
        "sft.save_every_steps=2",
    ]
    full = kubealign_subprocess("sft", *common, "--output", tmp_path / "run")
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"kubealign: error: sft: cannot save the checkpoint {re.escape(str(small_disk / 'step4'))}: "
        rf"No space left on device; [0-9.]+ MiB free in {re.escape(str(small_disk))}; "
        rf"the partial step4 was removed and the last good checkpoint, {re.escape(str(small_disk / 'step2'))}, is kept",
        last,
    ), last
    assert sorted(p.name for p in small_disk.iterdir()) == ["latest", "step2"]
    assert (small_disk / "latest").read_text() == "step2"
    checkpoints.verify(small_disk)  # the last good one is whole
    assert not (tmp_path / "run").exists()


# --- links under a checkpoint directory (issue 54: each was followed before) -------------------------------------


def test_a_linked_checkpoint_directory_is_refused_and_its_target_kept(split_dir: Path, tmp_path: Path):  # noqa: F811
    """X.checkpoints -> a user's folder holding step9/: `kubealign sft --resume` used to train into it and remove
    step9/ at its end. Refused at the start, with and without --resume; the folder is untouched."""
    mine = tmp_path / "my-folder"
    fake_checkpoint(mine, "step9").joinpath("notes.txt").write_text("mine")
    (tmp_path / "run.checkpoints").symlink_to(mine)
    for resume in (True, False):
        with pytest.raises(UserError, match=r"run.checkpoints is a symbolic link \(to .*my-folder\)"):
            checkpoints.checkpoint_dir(tmp_path / "run", resume=resume)
    common = ["--data", split_dir, "--set", "tracking.enabled=false", "--set", "sft.num_train_epochs=0.1"]
    refused = kubealign_subprocess("sft", *common, "--resume", "--output", tmp_path / "run")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "run.checkpoints is a symbolic link" in refused.stderr.strip().splitlines()[-1]
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == [
        "latest",
        "step9",
        "step9/mp_rank_00_model_states.pt",
        "step9/notes.txt",
        "step9/sub",
        "step9/sub/optim.pt",
    ]
    save = tmp_path / "ppo.checkpoints"
    save.mkdir()
    (save / "critic").symlink_to(mine)  # a part directory of PPO's: the same
    with pytest.raises(UserError, match=r"ppo.checkpoints/critic is a symbolic link"):
        checkpoints.checkpoint_dir(tmp_path / "ppo", resume=True)


@pytest.mark.parametrize("planted", ["tag", "file"])
def test_saving_refuses_a_link_planted_as_the_next_tag_or_in_it(tmp_path: Path, planted: str):
    """DeepSpeed opens the tag's files for writing and follows links: a planted step2 -> elsewhere, or a
    step2/mp_rank_00_model_states.pt -> a user's file, was written through (the file overwritten)."""
    save, user = tmp_path / "run.checkpoints", tmp_path / "user"
    sealed_checkpoint(save, "step1")
    user.mkdir()
    (user / "thesis.pt").write_bytes(b"mine")
    if planted == "tag":
        (save / "step2").symlink_to(user)
        link = save / "step2"
    else:
        (save / "step2").mkdir()
        link = save / "step2" / "mp_rank_00_model_states.pt"
        link.symlink_to(user / "thesis.pt")
    refused = rf"sft: saving step2: {re.escape(str(link))} is a symbolic link"
    with pytest.raises(UserError, match=refused), checkpoints.saving(save, "step2", "sft"):
        (save / "step2" / "mp_rank_00_model_states.pt").write_bytes(b"weights")  # never reached
    assert (user / "thesis.pt").read_bytes() == b"mine" and sorted(p.name for p in user.iterdir()) == ["thesis.pt"]
    assert checkpoints.latest_tag(save) == "step1"
    # a real tag directory left by a killed save is no link: saving into it goes ahead
    with checkpoints.saving(save, "step3", "sft"):
        (save / "step3").mkdir()
    with checkpoints.saving(save, "step3", "sft"):
        (save / "step3" / "mp_rank_00_model_states.pt").write_bytes(b"weights")


def test_latest_naming_a_path_outside_is_never_loaded(tmp_path: Path, caplog):
    """`latest` = ../outside/step9 used to load that directory's pickles unverified: only a tag of kubealign's
    form inside the directory is taken; the newest sealed tag otherwise, saying why."""
    save = tmp_path / "run.checkpoints"
    fake_checkpoint(tmp_path / "outside", "step9")
    save.mkdir()
    (save / "latest").write_text("../outside/step9")
    assert checkpoints.resume_tag(save) is None  # nothing of its own to resume: a fresh start, not outside
    sealed_checkpoint(save, "step2")
    (save / "latest").write_text("../outside/step9")
    with caplog.at_level(logging.WARNING):
        assert checkpoints.resume_tag(save) == "step2"
    assert "names '../outside/step9', which is not a kubealign checkpoint tag; resuming from step2" in caplog.text
    with pytest.raises(UserError, match=r"names '../outside/step9', which is not a kubealign checkpoint tag"):
        checkpoints.verify(save)


def test_resume_refuses_a_sealed_or_unsealed_tag_that_holds_a_link(tmp_path: Path):
    """A sealed tag whose file was swapped for a link to identical bytes passed the sha256 check (the hash
    follows the link); an unsealed tag named by `latest` loaded unverified through its links."""
    save = tmp_path / "run.checkpoints"
    tag_dir = sealed_checkpoint(save, "step4")
    copy = tmp_path / "elsewhere.pt"
    copy.write_bytes((tag_dir / "sub" / "optim.pt").read_bytes())
    (tag_dir / "sub" / "optim.pt").unlink()
    (tag_dir / "sub" / "optim.pt").symlink_to(copy)
    with pytest.raises(UserError, match=r"--resume: .*step4/sub/optim.pt is a symbolic link \(to .*elsewhere.pt\)"):
        checkpoints.resume_tag(save)
    old = tmp_path / "old.checkpoints"
    fake_checkpoint(old, "step7")  # an older kubealign's: no manifest
    (old / "step7" / "sub").rename(tmp_path / "sub")
    (old / "step7" / "sub").symlink_to(tmp_path / "sub")
    with pytest.raises(UserError, match=r"--resume: .*step7/sub is a symbolic link"):
        checkpoints.resume_tag(old)


def test_cleanup_keeps_an_unsealed_tag_it_did_not_write(tmp_path: Path):
    """Removal is limited to tags kubealign sealed or this process wrote: a torn step8 of an earlier run (or a
    directory of that name the user made) stays; a torn step6 this process began is removed."""
    save = tmp_path / "run.checkpoints"
    sealed_checkpoint(save, "step2")
    (save / "step8").mkdir()
    (save / "step8" / "analysis.txt").write_text("mine")
    with pytest.raises(OSError), checkpoints.saving(save, "step6", "sft"):
        (save / "step6").mkdir()
        raise OSError("not a disk error: passes through, the torn tag stays until cleanup")
    assert (save / "step6").is_dir()
    checkpoints.remove(save)
    assert sorted(p.relative_to(save).as_posix() for p in save.rglob("*")) == ["step8", "step8/analysis.txt"]
