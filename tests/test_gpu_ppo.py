"""PPO on CUDA: the rollout's log-probs match the training forward, and the sampling settings reach the
log-probs (skipped without a GPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import NO_TRACKING
from tests.test_ppo import ppo_args, trained  # noqa: F401  (module-scoped fixture: split, sft, rm)
from tests.test_training import result_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("zero", [0, 3])
def test_ratio_is_one_before_each_first_step_on_cuda(cli, trained, tmp_path: Path, zero: int):  # noqa: F811
    out = tmp_path / "ppo"
    stages = ["--set", f"ppo.actor_zero_stage={zero}", "--set", f"ppo.critic_zero_stage={zero}"]
    sampling = ["--set", "ppo.temperature=0.8", "--set", "ppo.top_p=0.95", "--set", "ppo.top_k=40"]
    measured = ["--set", "ppo.reuse_first_forward=none"]  # the training forward run again, not reused
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=3", *stages, *sampling, *measured, "--output", out]
    result = cli(*ppo_args(trained, *args))
    assert result.code == 0, result.err
    res = result_of(out)
    for row in res["history"]:
        assert all(math.isfinite(v) for v in row.values()), row
        # GPU kernels may round a batch of 16 differently from a permuted batch of 16: allow float noise,
        # nothing more: a larger gap means the rollout's log-prob pass and the training forward disagree.
        assert abs(row["approx_kl_first"]) < 1e-6 and row["clip_fraction_first"] == 0, row
    assert res["metrics"]["kl_before"] == pytest.approx(0, abs=1e-4)


def test_top_k_1_rollouts_have_no_entropy_on_cuda(cli, trained, tmp_path: Path):  # noqa: F811
    out = tmp_path / "ppo"
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=2", "--set", "ppo.top_k=1", "--output", out]
    result = cli(*ppo_args(trained, *args))
    assert result.code == 0, result.err
    assert all(row["entropy"] == 0 and row["kl"] == 0 for row in result_of(out)["history"])
