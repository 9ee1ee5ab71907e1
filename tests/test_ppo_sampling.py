"""PPO's log-probs describe the distribution that sampled: greedy-by-top-k rollouts have zero entropy,
zero KL to the reference and a ratio of exactly 1 before each first step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import NO_TRACKING
from tests.test_ppo import ppo_args, trained  # noqa: F401  (module-scoped fixture: split, sft, rm)
from tests.test_training import result_of

pytestmark = pytest.mark.integration


def test_top_k_1_rollouts_have_no_entropy_and_no_kl(cli, trained, tmp_path: Path):  # noqa: F811
    out = tmp_path / "ppo"
    sampling = ["--set", "ppo.top_k=1", "--set", "ppo.temperature=0.7", "--set", "ppo.top_p=0.9"]
    measured = ["--set", "ppo.reuse_first_forward=none"]  # the first minibatch's ratio from a second forward
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=2", *sampling, *measured, "--output", out]
    result = cli(*ppo_args(trained, *args))
    assert result.code == 0, result.err
    res = result_of(out)
    for row in res["history"]:
        # top-k 1 leaves the argmax only: the sampling distribution is a point mass, whatever the model.
        assert row["entropy"] == 0 and row["kl"] == 0, row
        assert row["approx_kl_first"] == 0 and row["clip_fraction_first"] == 0
        assert all(math.isfinite(v) for v in row.values())
    assert res["metrics"]["kl_before"] == 0 and res["metrics"]["kl_after"] == 0
