"""What a stage command leaves and says: bad input writes nothing (no MLflow store beside --output either: exit
2, one line), and the libraries' chatter (MLflow's INFO lines, DeepSpeed's notice that the Hybrid Engine has no
kernels for the model) stays off the screen unless -v / --verbose or KUBEALIGN_VERBOSE=1 asks for it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.conftest import pairs, write_jsonl

HE_NOTICE = "inference acceleration is unavailable"


def run(*args: object, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kubealign.cli", *map(str, args)]
    environ = {k: v for k, v in os.environ.items() if k not in ("KUBEALIGN_VERBOSE", "MLFLOW_LOGGING_LEVEL")}
    return subprocess.run(argv, env={**environ, **(env or {})}, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_data_split_with_a_missing_source_leaves_nothing_beside_its_output(tmp_path: Path, cli):
    work = tmp_path / "work"
    work.mkdir()
    done = cli("data-split", "--source", tmp_path / "absent.jsonl", "--output", work / "split")
    assert done.code == 2 and len(done.err.strip().splitlines()) == 1, done.err
    assert list(work.iterdir()) == []
    done = cli("data-split", "--source", tmp_path / "absent.jsonl", "--output", tmp_path / "new" / "split")
    assert done.code == 2 and not (tmp_path / "new").exists()


def test_sft_without_its_data_leaves_nothing_beside_its_output(tmp_path: Path, cli):
    done = cli("sft", "--data", tmp_path / "nonexistent", "--output", tmp_path / "work" / "sft")
    assert done.code == 2 and len(done.err.strip().splitlines()) == 1, done.err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_stage_keeps_the_store_an_earlier_command_made_and_a_later_one_uses_it(tmp_path: Path, cli):
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs(40))
    assert cli("data-split", "--source", source, "--output", tmp_path / "one").code == 0
    assert cli("data-split", "--source", tmp_path / "absent.jsonl", "--output", tmp_path / "two").code == 2
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "mlartifacts").is_dir()
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        statuses = sorted(status for (status,) in db.execute("SELECT status FROM runs"))
    assert statuses == ["FAILED", "FINISHED"]  # the failed run is kept in a store this command did not make


def test_a_store_removed_after_bad_input_is_made_again_by_the_next_stage_in_the_same_process(tmp_path: Path, cli):
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs(40))
    assert cli("data-split", "--source", tmp_path / "absent.jsonl", "--output", tmp_path / "one").code == 2
    assert not (tmp_path / "mlflow.db").exists()
    done = cli("data-split", "--source", source, "--output", tmp_path / "two")
    assert done.code == 0, done.err
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert [status for (status,) in db.execute("SELECT status FROM runs")] == ["FINISHED"]


def test_a_stage_says_nothing_of_mlflow_unless_asked(tmp_path: Path):
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs(40))
    quiet = run("data-split", "--source", source, "--output", tmp_path / "quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO mlflow" not in quiet.stderr and quiet.stderr.strip() == "", quiet.stderr
    loud = run("data-split", "-v", "--source", source, "--output", tmp_path / "loud" / "split")
    assert loud.returncode == 0 and "INFO mlflow" in loud.stderr, loud.stderr
    loud = run("data-split", "--source", source, "--output", tmp_path / "env" / "split", env={"KUBEALIGN_VERBOSE": "1"})
    assert loud.returncode == 0 and "INFO mlflow" in loud.stderr, loud.stderr


QUIETED = f"""
import sys
from kubealign.cli.training import quiet_libraries
quiet_libraries(verbose=sys.argv[1] == "-v")
from deepspeed.utils import logger
logger.warning("No compatible DeepSpeed inference policy found for model type OPTForCausalLM. Hybrid Engine "
               "{HE_NOTICE}; rollout will use the model's native generate() path.")
logger.warning("a DeepSpeed warning that matters")
"""


def test_deepspeed_s_hybrid_engine_notice_is_shown_only_when_asked(tmp_path: Path):
    quiet = subprocess.run([sys.executable, "-c", QUIETED, "-q"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert HE_NOTICE not in quiet.stdout + quiet.stderr and "a DeepSpeed warning that matters" in quiet.stdout
    loud = subprocess.run([sys.executable, "-c", QUIETED, "-v"], capture_output=True, text=True, timeout=120)
    assert HE_NOTICE in loud.stdout + loud.stderr, loud.stderr
