"""The vLLM rollout engine in the RL stages (ppo.rollout.engine vllm): the ppo stage trains with it (the actor's
weights loaded into vLLM before every rollout: the rollout's log-probs stay the trainer's, which the mismatch
bound would stop the run on otherwise), and `kubealign run` through kfp.local with it promotes a model.

Runs in the vLLM trainer environment (make test-vllm-rollout); skips without vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_rollout
pytest.importorskip("vllm", reason="needs vLLM: the .venv-vllm environment (make test-vllm-rollout)")

from tests.conftest import NO_TRACKING  # noqa: E402
from tests.stages.test_ppo import ppo_args, trained  # noqa: E402, F401
from tests.stages.test_training import result_of  # noqa: E402

VLLM = ["--set", "ppo.rollout.engine=vllm"]


def test_the_ppo_stage_trains_with_vllm_generating_from_the_actors_current_weights(cli, trained, tmp_path):  # noqa: F811
    out = tmp_path / "ppo"
    sets = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=6", "--set", "ppo.actor_learning_rate=3e-4"]
    result = cli(*ppo_args(trained, *sets, *VLLM, "--output", out))
    assert result.code == 0, result.err
    res = result_of(out)
    assert res["rollout_engine"] == "vllm"
    assert "ppo: ppo.rollout.engine vllm: vLLM in the trainer's process" in result.out
    # Every iteration after the first samples from weights the updates changed: stale weights in vLLM would
    # differ from the trainer's by far more than fp32 rounding (and trip ppo.rollout.max_logprob_diff).
    diffs = [row["rollout_logprob_diff_mean"] for row in res["history"]]
    assert len(diffs) == 6 and max(diffs) < 1e-4, diffs
    assert res["history"][-1]["kl"] > 1e-3  # the actor did move away from the reference it started as


def test_kubealign_run_with_the_vllm_engine_promotes_a_model(tmp_path: Path):
    """The whole DAG through kfp.local, shortened, the ppo task generating with vLLM."""
    from tests.pipelines.test_kfp_local import overrides

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "kubealign.cli", "run", *overrides(), *VLLM, "--output", str(out)]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout
    index = json.loads((out / "run.json").read_text(encoding="utf-8"))
    ppo = json.loads((Path(index["stages"]["ppo"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    promote = json.loads((Path(index["stages"]["promote"]["dir"]) / "result.json").read_text(encoding="utf-8"))
    assert ppo["rollout_engine"] == "vllm"
    assert promote["version"] == 1 and promote["aliases"]["champion"] == 1, promote
