"""Shared fixtures. Tiny models build into a per-session cache; tracking defaults to a temp store."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Set before anything imports tqdm, datasets or huggingface_hub: they read these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TQDM_DISABLE"] = "1"
# One intra-op thread per test process and the stages it starts (a user's own setting wins): the tiny models'
# matrices are too small for a second thread to pay (tests/stages/test_grpo.py on 2 cores: 214 s with 2 threads and
# 336 s of CPU, 219 s of CPU with 1), and `make test` runs a pytest worker per core (pytest-xdist), which
# two-thread processes would oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed's CPU backend JIT-builds its shared-memory op in every process (kubealign.training.oplocks) into
# TORCH_EXTENSIONS_DIR, which every stage sets, unless the user did, to a directory of this Python environment (torch's
# default is one for all environments of the machine: ninja rebuilds the op whenever another one used it last). Set
# here for the whole session too, so that the tests that look at the op before any stage starts see the same one.
from kubealign.training.oplocks import use_environment_dir  # noqa: E402

use_environment_dir()

import pytest  # noqa: E402

from kubealign.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
HH_FILE = SHARED_DATA / "hh-rlhf" / "harmless-base-test.jsonl.gz"
NO_TRACKING = "tracking.enabled=false"


@pytest.fixture(autouse=True)
def _deepspeed_logs_to_an_open_stream():
    """DeepSpeed's logger binds a StreamHandler to sys.stdout when deepspeed is first imported. Imported first
    inside a test that captures output (capsys), that stream is closed after the test, and every later
    DeepSpeed log line becomes a "--- Logging error ---" traceback on stderr (breaking one-line-error
    checks): point it at the process's own stdout, which pytest's fd capture keeps open."""
    import logging
    import sys

    logger = logging.Logger.manager.loggerDict.get("DeepSpeed")
    for handler in getattr(logger, "handlers", []):
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            handler.stream = sys.__stdout__  # not setStream: it flushes the closed stream first


@pytest.fixture(autouse=True, scope="session")
def _isolated_environment(tmp_path_factory: pytest.TempPathFactory):
    """Keep tests off the user's caches and any MLflow server configured in the environment."""
    saved = dict(os.environ)
    os.environ["KUBEALIGN_CACHE_DIR"] = str(tmp_path_factory.mktemp("kubealign-cache"))
    # Every `mlflow server` a test starts would also start MLflow's job runner (a second Python process with
    # its own consumers, for MLflow's GenAI jobs, which kubealign never submits): CPU taken from the tests.
    os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    for key in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_RUN_ID",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "RANK",
        "KUBERNETES_SERVICE_HOST",  # a CI runner in a pod: the tests' local stores are what they mean
    ):
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def hh_file() -> Path:
    if not HH_FILE.exists():
        pytest.skip(f"real-data file {HH_FILE} is absent (../shared/data is not beside the repo)")
    return HH_FILE


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """Run `kubealign ARGS...` in-process; returns exit code, stdout and stderr."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pairs(n: int, start: int = 0) -> list[dict[str, str]]:
    """n distinct, valid prompt/chosen/rejected rows."""
    return [
        {"prompt": f"\n\nHuman: question {i}?\n\nAssistant:", "chosen": f" good {i}", "rejected": f" bad {i}"}
        for i in range(start, start + n)
    ]


# The tiers a test can be in (pyproject.toml's markers). A test that names none is pure and fast by
# construction of this suite's conventions, so it joins the `unit` tier: `make test-unit` selects `-m unit`.
TIERS = frozenset(
    {
        "unit",
        "integration",
        "kfp",
        "chart",
        "gpu",
        "slow",
        "container",
        "train_image",
        "vllm",
        "vllm_rollout",
        "serve_image",
        "faults",
        "system",
        "multinode",
        "reproduce",
        "rounds",
        "labelstudio",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not TIERS.intersection(m.name for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)
