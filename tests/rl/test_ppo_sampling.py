"""PPO's log-probs are those of the tempered, unfiltered distribution (losses.scaled_logits): with top-k 1
the rollout is greedy, yet the log-probs, the entropy and the KL come from the whole tempered softmax —
finite, a ratio of exactly 1 before each first step, and KL exactly 0 while the actor is the reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import NO_TRACKING
from tests.stages.test_ppo import ppo_args, trained  # noqa: F401  (module-scoped fixture: split, sft, rm)
from tests.stages.test_training import result_of

pytestmark = pytest.mark.integration


def test_top_k_1_rollouts_keep_the_unfiltered_entropy_and_a_ratio_of_one(cli, trained, tmp_path: Path):  # noqa: F811
    out = tmp_path / "ppo"
    sampling = ["--set", "ppo.top_k=1", "--set", "ppo.temperature=0.7", "--set", "ppo.top_p=0.9"]
    measured = ["--set", "ppo.reuse_first_forward=none"]  # the first minibatch's ratio from a second forward
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=2", *sampling, *measured, "--output", out]
    result = cli(*ppo_args(trained, *args))
    assert result.code == 0, result.err
    res = result_of(out)
    for row in res["history"]:
        # Filtered, top-k 1 would be a point mass (entropy 0); the tempered softmax it is drawn from is not.
        assert row["entropy"] > 0.01, row
        assert row["approx_kl_first"] == 0 and row["clip_fraction_first"] == 0
        assert all(math.isfinite(v) for v in row.values())
    assert res["history"][0]["kl"] == 0  # the first rollout's actor is the reference: exactly 0
    # After the updates the actor differs from the reference. (The KL estimate on greedy samples is not
    # KL(actor || reference): the tokens are not drawn from the unfiltered softmax, so it may be < 0.)
    assert res["metrics"]["kl_before"] == 0 and res["metrics"]["kl_after"] != 0
