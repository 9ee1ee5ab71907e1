"""PPO math against hand-computed values, a plain-Python reference, and masking invariances."""

from __future__ import annotations

import math

import pytest
import torch

from kubealign.rl.advantages import gae, kl_penalized_rewards, masked_mean, whiten
from kubealign.rl.kl import KLController
from kubealign.rl.losses import (
    PolicyLossSettings,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_by_hand():
    values, rewards, mask = t([9, 1, 2, 3]), t([9, 0, 0, 1]), t([0, 1, 1, 1])
    # gamma 1, lambda 0.5: A3 = 1 - 3 = -2; A2 = (0 + 3 - 2) + 0.5 * -2 = 0; A1 = (0 + 2 - 1) + 0.5 * 0 = 1
    out = gae(values, rewards, mask, gamma=1.0, lam=0.5)
    assert out.advantages.tolist() == [[0, 1, 0, -2]]
    assert out.returns.tolist() == [[0, 2, 2, 1]]
    # gamma 0.9, lambda 1: returns are discounted reward sums, R1 = 0.81 * 1
    out = gae(values, rewards, mask, gamma=0.9, lam=1.0)
    assert out.advantages[0].tolist() == pytest.approx([0, -0.19, -1.1, -2])
    assert out.returns[0, 1].item() == pytest.approx(0.81)


def test_gae_does_not_bootstrap_from_padding_and_ignores_masked_values():
    mask = t([1, 1, 0, 0])
    a = gae(t([1, 2, 50, 60]), t([0, 1, 7, 8]), mask, 1.0, 0.95)
    b = gae(t([1, 2, -5, 0]), t([0, 1, 0, 3]), mask, 1.0, 0.95)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
    assert a.advantages[0, 1].item() == pytest.approx(1 - 2)  # last response action: r - V, no V_{t+1}


def reference_gae(values, rewards, mask, gamma, lam):
    """Per-row, per-step Python loop over the response actions only."""
    out = []
    for v_row, r_row, m_row in zip(values.tolist(), rewards.tolist(), mask.tolist(), strict=True):
        idx = [i for i, m in enumerate(m_row) if m]
        adv = [0.0] * len(m_row)
        running = 0.0
        for k in reversed(range(len(idx))):
            i = idx[k]
            next_v = v_row[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r_row[i] + gamma * next_v - v_row[i]
            running = delta + gamma * lam * running
            adv[i] = running
        out.append(adv)
    return torch.tensor(out, dtype=values.dtype)


def test_gae_matches_a_plain_loop_on_random_batches():
    torch.manual_seed(0)
    for _ in range(5):
        values, rewards = torch.randn(4, 9, dtype=torch.float64), torch.randn(4, 9, dtype=torch.float64)
        starts, lengths = torch.randint(0, 4, (4,)), torch.randint(1, 6, (4,))
        mask = torch.zeros(4, 9, dtype=torch.float64)
        for b in range(4):
            mask[b, starts[b] : starts[b] + lengths[b]] = 1  # left/right padding of varying size
        got = gae(values, rewards, mask, 0.99, 0.95).advantages
        assert torch.allclose(got, reference_gae(values, rewards, mask, 0.99, 0.95))


def test_kl_penalized_rewards_by_hand():
    out = kl_penalized_rewards(
        logprobs=t([-1, -2, -3, -4]),
        ref_logprobs=t([-1.5, -1, -3, -9]),
        scores=torch.tensor([10.0], dtype=torch.float64),
        response_mask=t([0, 1, 1, 0]),
        kl_coef=0.1,
        reward_clip=5.0,
    )
    assert out.kl.tolist() == [[0, -1, 0, 0]]
    assert out.rewards[0].tolist() == pytest.approx([0, 0.1, 5.0, 0])  # score clipped to 5 at the last action


def test_policy_loss_by_hand():
    logprobs = torch.log(t([1.5, 0.5]))
    out = policy_loss(logprobs, t([0, 0]), t([1, 1]), t([1, 1]), PolicyLossSettings(cliprange=0.2))
    # action 0: max(-1.5, -1.2) = -1.2 (clip active); action 1: max(-0.5, -0.8) = -0.5
    assert out.loss.item() == pytest.approx(-0.85)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    expected_kl = ((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))) / 2
    assert out.approx_kl.item() == pytest.approx(expected_kl)
    same = policy_loss(t([-0.3, -0.7]), t([-0.3, -0.7]), t([2, -1]), t([1, 1]), PolicyLossSettings(cliprange=0.2))
    assert same.loss.item() == pytest.approx(-(2 - 1) / 2) and same.approx_kl.item() == 0


def test_value_loss_by_hand_and_masking():
    out = value_loss(t([2.0, 99]), t([1.0, 0]), t([1.5, -99]), t([1, 0]), cliprange_value=0.2)
    # clipped V = 1.2: max((2 - 1.5)^2, (1.2 - 1.5)^2) = 0.25 -> 0.5 * 0.25
    assert out.loss.item() == pytest.approx(0.125)
    assert out.clip_fraction.item() == 0
    worse = value_loss(t([1.0]), t([2.0]), t([0.0]), t([1]), cliprange_value=0.2)
    # clipped V = 1.8: max(1, 3.24) -> 1.62, the clipped term is active
    assert worse.loss.item() == pytest.approx(1.62) and worse.clip_fraction.item() == 1


def test_logprobs_and_entropy_from_logits():
    logits = torch.zeros(1, 3, 4)
    ids = torch.tensor([[0, 1, 2]])
    assert logprobs_from_logits(logits, ids)[0].tolist() == pytest.approx([math.log(0.25)] * 2)
    assert entropy_from_logits(logits)[0].tolist() == pytest.approx([math.log(4)] * 2)


def test_whiten_and_masked_mean_ignore_masked_positions():
    x, mask = t([1, 2, 3, 100]), t([1, 1, 1, 0])
    assert masked_mean(x, mask).item() == 2
    assert whiten(x, mask)[0].tolist() == pytest.approx([-math.sqrt(1.5), 0, math.sqrt(1.5), 0], abs=1e-6)


def test_explained_variance():
    returns, mask = t([1, 2, 3]), t([1, 1, 1])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1)
    assert explained_variance(t([2, 2, 2]), returns, mask).item() == pytest.approx(0)


def test_adaptive_kl_controller_by_hand():
    fixed = KLController(0.1)
    assert fixed.update(50.0, 256) == 0.1
    ctl = KLController(0.1, target=6.0, horizon=10000)
    assert ctl.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))  # error clipped to +0.2
    before = ctl.value
    assert ctl.update(3.0, 256) == pytest.approx(before * (1 - 0.2 * 256 / 10000))
    restored = KLController(0.1, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_policy_loss_clips_a_shrinking_ratio_for_a_negative_advantage():
    # ratio 0.5, A = -1: max(0.5, 0.8) = 0.8 — the lower clip 1 - eps is what makes it 0.8
    out = policy_loss(torch.log(t([0.5])), t([0]), t([-1]), t([1]), PolicyLossSettings(cliprange=0.2))
    assert out.loss.item() == pytest.approx(0.8) and out.clip_fraction.item() == 1


def test_value_loss_clips_a_rise_and_counts_no_clip_when_nothing_moved():
    # V = 2 from old 1, R = 3: clipped V = 1.2, max((2 - 3)^2, (1.2 - 3)^2) = 3.24 -> 0.5 * 3.24
    up = value_loss(t([2.0]), t([1.0]), t([3.0]), t([1]), cliprange_value=0.2)
    assert up.loss.item() == pytest.approx(1.62) and up.clip_fraction.item() == 1
    still = value_loss(t([1.0]), t([1.0]), t([3.0]), t([1]), cliprange_value=0.2)
    assert still.loss.item() == pytest.approx(2.0) and still.clip_fraction.item() == 0


def test_gae_of_a_single_action():
    out = gae(t([2.0]), t([1.0]), t([1]), gamma=1.0, lam=0.95)
    assert out.advantages.tolist() == [[-1.0]] and out.returns.tolist() == [[1.0]]


def test_whiten_of_a_nearly_constant_batch_is_damped_by_eps():
    # var = (5e-5)^2 = 2.5e-9; out = ±5e-5 / sqrt(2.5e-9 + 1e-8)
    out = whiten(t([0.0, 1e-4]), t([1, 1]))
    assert out[0].tolist() == pytest.approx([-5e-5 / math.sqrt(1.25e-8), 5e-5 / math.sqrt(1.25e-8)])


def test_default_kl_horizon():
    ctl = KLController(0.1, target=1.0)
    assert ctl.update(2.0, 100) == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000), rel=1e-12)
