"""ppo.policy_loss (ppo, gspo, cispo, sapo) and ppo.rollout_correction by hand: rows of different lengths and
masks, ratios on both sides of every bound and both signs of the advantage, the gradients where what is held
constant is the point, and the plain policy gradient at ratio 1 for every choice."""

from __future__ import annotations

import math

import pytest
import torch

from kubealign.rl.correction import mismatch, rollout_weights
from kubealign.rl.losses import POLICY_LOSSES, PolicyLossSettings, policy_loss, sequence_log_ratio

LOW, HIGH = 0.2, 0.28  # bounds 0.8 and 1.28 (clip-higher: the two differ, so a swap shows)
GARBAGE = 7.0  # log-ratio outside the response: must not matter


def rows(ratios: list[list[float | None]], advantages: list[float]):
    """(logprobs leaf with grad, old, advantages, mask) for rows of width 4: None = outside the response
    (there the log-prob is garbage), each row one advantage on every action."""
    width = 4
    log_ratio = [
        [math.log(r) if r is not None else GARBAGE for r in row] + [GARBAGE] * (width - len(row)) for row in ratios
    ]
    mask = [[1.0 if r is not None else 0.0 for r in row] + [0.0] * (width - len(row)) for row in ratios]
    logprobs = torch.tensor(log_ratio, dtype=torch.float64) - 1.0  # old log-probs -1: the ratio is what counts
    logprobs.requires_grad_(True)
    old = torch.full_like(logprobs, -1.0)
    adv = torch.tensor(advantages, dtype=torch.float64)[:, None].expand(-1, width).clone()
    return logprobs, old, adv, torch.tensor(mask, dtype=torch.float64)


def close(x: torch.Tensor, expected) -> bool:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    return torch.allclose(x.double(), expected, rtol=1e-6, atol=1e-9)


def settings(kind: str = "ppo", **kwargs) -> PolicyLossSettings:
    """This file's bounds (LOW, HIGH) for the surrogate `kind`, other settings as given."""
    return PolicyLossSettings(kind, LOW, HIGH)._replace(**kwargs)


def loss_and_grad(kind: str, ratios, advantages, **kwargs):
    logprobs, old, adv, mask = rows(ratios, advantages)
    out = policy_loss(logprobs, old, adv, mask, settings(kind, **kwargs))
    out.loss.backward()
    return out, logprobs.grad


# Row 0 (A = +1, three actions): above the upper bound, inside, below the lower bound. Row 1 (A = -2, one action,
# after a masked one): below the lower bound. Row 2 (A = -1, two actions): inside, above the upper bound.
TOKEN_RATIOS = [[1.5, 1.1, 0.5], [None, 0.5], [0.9, 1.5]]
TOKEN_ADV = [1.0, -2.0, -1.0]


def test_ppo_clips_each_side_only_where_the_advantage_pushes_past_it():
    out, grad = loss_and_grad("ppo", TOKEN_RATIOS, TOKEN_ADV)
    # row 0: max(-1.5, -1.28) = -1.28 (clipped), -1.1, max(-0.5, -0.8) = -0.5; row 1: max(1.0, 1.6) = 1.6 (clipped);
    # row 2: 0.9, max(1.5, 1.28) = 1.5 — swapping the bounds (0.72, 1.2) moves rows 0 and 1
    per_token = [[-1.28, -1.1, -0.5, 0], [0, 1.6, 0, 0], [0.9, 1.5, 0, 0]]
    assert out.loss.item() == pytest.approx(sum(map(sum, per_token)) / 6)
    assert out.clip_fraction.item() == pytest.approx(2 / 6)
    # d/dlogp of -A r is -A r where the unclipped side is the max, 0 where the clipped side is
    assert close(grad, [[0, -1.1 / 6, -0.5 / 6, 0], [0, 0, 0, 0], [0.9 / 6, 1.5 / 6, 0, 0]])
    seq = loss_and_grad("ppo", TOKEN_RATIOS, TOKEN_ADV, aggregation="sequence")[0]
    assert seq.loss.item() == pytest.approx((-2.88 / 3 + 1.6 + 2.4 / 2) / 3)


def test_clip_higher_bounds_are_not_interchangeable():
    # the upper bound alone (A > 0, ratio above both 1.2 and 1.28) and the lower alone (A < 0, ratio below both)
    up, _ = loss_and_grad("ppo", [[1.5]], [1.0])
    down, _ = loss_and_grad("ppo", [[0.5]], [-1.0])
    assert (up.loss.item(), down.loss.item()) == pytest.approx((-1.28, 0.8))


# Sequence ratios (geometric means): row 0 2^(1/3) = 1.26 inside although its first token's 2.0 is not; row 1 0.5
# below (A < 0: clipped); row 2 1.5 above with A < 0 (not clipped); row 3 1.5 above with A > 0 (clipped).
SEQ_RATIOS = [[2.0, 1.0, 1.0], [None, 0.5], [1.5, 1.5], [1.5, None, 1.5]]
SEQ_ADV = [1.0, -2.0, -1.0, 1.0]


def test_gspo_clips_the_geometric_mean_ratio_of_each_sequence():
    out, grad = loss_and_grad("gspo", SEQ_RATIOS, SEQ_ADV)
    s0 = 2 ** (1 / 3)
    assert s0 < 1 + HIGH < 2.0
    total = 3 * -s0 + 1.6 + 2 * 1.5 + 2 * -1.28
    assert out.loss.item() == pytest.approx(total / 8)
    assert out.clip_fraction.item() == pytest.approx(3 / 8)  # row 1's one action and row 3's two
    # GSPO's gradient: d(-A s_i)/dlogp_t = -A s_i / |y_i| per action, summed over the row's |y_i| actions' terms
    expected = [[-s0 / 8] * 3 + [0], [0, 0, 0, 0], [1.5 / 8, 1.5 / 8, 0, 0], [0, 0, 0, 0]]
    assert close(grad, expected)
    # the paper's aggregation: each response's mean, then the mean over responses
    seq = loss_and_grad("gspo", SEQ_RATIOS, SEQ_ADV, aggregation="sequence")[0]
    assert seq.loss.item() == pytest.approx((-s0 + 1.6 + 1.5 - 1.28) / 4)


def test_gspo_with_per_token_advantages_keeps_each_tokens_own_advantage():
    # GSPO-token (eq. 13): the value is the sequence ratio, the gradient each token's own -A_t s grad log pi_t
    logprobs, old, _, mask = rows([[1.2, 1.0]], [0.0])
    adv = torch.tensor([[1.0, -3.0, 0, 0]], dtype=torch.float64)
    policy_loss(logprobs, old, adv, mask, settings("gspo")).loss.backward()
    s = 1.2**0.5  # inside both bounds
    assert close(logprobs.grad, [[-1.0 * s / 2, 3.0 * s / 2, 0, 0]])


def test_sequence_log_ratio_is_the_mean_over_the_response():
    log_ratio = torch.tensor([[1.0, 2.0, 9.0], [9.0, 4.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 0]])
    assert sequence_log_ratio(log_ratio * mask, mask).tolist() == [[1.5], [4.0], [0.0]]


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    out, grad = loss_and_grad("cispo", TOKEN_RATIOS, TOKEN_ADV)
    # w = clip(r, 0.8, 1.28): 1.28, 1.1, 0.8 | 0.8 | 0.9, 1.28; each action's loss -A w
    per_token = [[-1.28, -1.1, -0.8, 0], [0, 1.6, 0, 0], [0.9, 1.28, 0, 0]]
    assert out.loss.item() == pytest.approx(sum(map(sum, per_token)) / 6)
    assert out.clip_fraction.item() == pytest.approx(4 / 6)  # 1.5, 0.5, 0.5, 1.5
    # the gradient is -A sg[w] grad log pi: non-zero where PPO's clip gives none, and w counts once (a weight
    # left in the graph would add -A dw/dlogp = -A r inside the bounds)
    assert close(grad, [[x / 6 for x in row] for row in per_token])


def test_cispo_with_cliprange_one_has_no_lower_bound():
    logprobs, old, adv, mask = rows([[0.1, 2.0]], [-1.0])
    out = policy_loss(logprobs, old, adv, mask, PolicyLossSettings("cispo", cliprange=1.0, cliprange_high=0.28))
    assert out.loss.item() == pytest.approx((0.1 + 1.28) / 2)


def sapo_by_hand(ratio: float, adv: float, tau: float) -> tuple[float, float]:
    """(loss, d loss / d logp) of one action: -A sigmoid(tau (r - 1)) 4 / tau, dr/dlogp = r."""
    sig = 1 / (1 + math.exp(-tau * (ratio - 1)))
    return -adv * sig * 4 / tau, -adv * 4 * sig * (1 - sig) * ratio


def test_sapo_gates_softly_with_a_temperature_per_advantage_sign():
    taus = (1.0, 2.0)  # far apart: using tau_pos for a negative advantage would show
    out, grad = loss_and_grad(
        "sapo", TOKEN_RATIOS, TOKEN_ADV, sapo_temperature_pos=taus[0], sapo_temperature_neg=taus[1]
    )
    expected = [
        [sapo_by_hand(r, a, taus[0] if a > 0 else taus[1]) if r else (0, 0) for r in row]
        for row, a in zip(TOKEN_RATIOS, TOKEN_ADV, strict=True)
    ]
    loss = sum(v for row in expected for v, _ in row) / 6
    assert out.loss.item() == pytest.approx(loss)
    grads = [[g for _, g in row] + [0] * (4 - len(row)) for row in expected]
    assert close(grad, [[g / 6 for g in row] for row in grads])
    # no token's gradient is cut to 0 (the gate fades, it has no cliff); the clip fraction is where PPO would clip
    assert bool((grad[torch.tensor(TOKEN_MASK).bool()] != 0).all())
    assert out.clip_fraction.item() == pytest.approx(2 / 6)


TOKEN_MASK = [[1, 1, 1, 0], [0, 1, 0, 0], [1, 1, 0, 0]]


def test_sapo_defaults_are_trls():
    out, grad = loss_and_grad("sapo", [[1.5], [1.5]], [1.0, -1.0])
    (lp, gp), (ln, gn) = sapo_by_hand(1.5, 1.0, 1.0), sapo_by_hand(1.5, -1.0, 1.05)
    assert out.loss.item() == pytest.approx((lp + ln) / 2)
    assert grad[:, 0].tolist() == pytest.approx([gp / 2, gn / 2])


@pytest.mark.parametrize("kind", POLICY_LOSSES)
def test_every_choice_is_the_plain_policy_gradient_at_ratio_one(kind):
    """Before the first step the new policy is the old one: every choice's gradient is -A grad log pi per
    action (here / the 6 actions), and its value -A (sapo: -2 A / tau, its gate's value at 1)."""
    ratios = [[1.0, 1.0, 1.0], [None, 1.0], [1.0, 1.0]]
    out, grad = loss_and_grad(kind, ratios, TOKEN_ADV)
    adv = torch.tensor(TOKEN_ADV, dtype=torch.float64)[:, None] * torch.tensor(TOKEN_MASK, dtype=torch.float64)
    assert close(grad, (-adv / 6).tolist())
    values = {"sapo": -adv * torch.where(adv > 0, 2 / 1.0, 2 / 1.05)}
    assert out.loss.item() == pytest.approx(float(values.get(kind, -adv).sum() / 6))
    assert out.clip_fraction.item() == 0 and out.approx_kl.item() == 0


def test_an_unknown_policy_loss_is_refused():
    logprobs, old, adv, mask = rows([[1.0]], [1.0])
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        policy_loss(logprobs, old, adv, mask, settings("grpo"))


# --- rollout correction -------------------------------------------------------------------------------------


# w = pi_trainer / pi_rollout per action: around the tis cap 2, on the mask's bounds 0.5 and 2 and either side
W = [[3.0, 2.0, 1.9, 0.5], [0.45, 0.55, 1.0, 2.1]]
W_MASK = [[1, 1, 1, 1], [1, 1, 0, 1]]


def weights_of(kind: str, **bounds):
    trainer = torch.tensor(W, dtype=torch.float64).log()  # exp(log w - 0) is w exactly: the bounds are hit
    rollout = torch.zeros_like(trainer)
    return rollout_weights(trainer, rollout, torch.tensor(W_MASK), kind, **bounds)


def test_tis_truncates_the_weight_at_its_cap():
    out = weights_of("tis", cap=2.0)
    assert close(out.weights, [[2.0, 2.0, 1.9, 0.5], [0.45, 0.55, 1.0, 2.0]])
    assert out.corrected.tolist() == [[True, False, False, False], [False, False, False, True]]
    assert weights_of("tis", cap=3.0).weights[0, 0].item() == pytest.approx(3.0)


def test_mask_drops_the_tokens_outside_its_bounds_inclusive():
    out = weights_of("mask", low=0.5, high=2.0)
    assert out.weights.tolist() == [[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]
    assert out.corrected.tolist() == [[True, False, False, False], [True, False, False, True]]  # not the masked 1.0
    assert weights_of("mask", low=0.4, high=2.5).weights.tolist() == [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_no_correction_weighs_every_token_one():
    out = weights_of("none")
    assert out.weights.tolist() == [[1.0] * 4] * 2 and not bool(out.corrected.any())
    with pytest.raises(ValueError, match="unknown rollout correction 'is'"):
        weights_of("is")


def test_the_correction_weights_the_loss_and_carries_no_gradient():
    logprobs, old, adv, mask = rows([[1.0, 1.0, 1.0], [None, 1.0]], [1.0, -2.0])
    weights = torch.tensor([[2.0, 0.5, 0.0, 9.0], [9.0, 1.5, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logprobs, old, adv, mask, settings(), weights=weights)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-2.0 - 0.5 - 0.0 + 2 * 1.5) / 4)  # the denominator stays 4 tokens
    assert close(logprobs.grad, [[-0.5, -0.125, 0, 0], [0, 0.75, 0, 0]])
    assert weights.grad is None or not bool(weights.grad.any())


def test_mismatch_by_hand_and_zero_for_one_computation():
    trainer = torch.tensor([[-1.0, -2.0, 50.0], [-0.5, -3.0, -1.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert mismatch(trainer, rollout, mask) == pytest.approx((2.5, 2.0, 5.0))
    assert mismatch(trainer, trainer, mask) == (0.0, 0.0, 5.0)
    assert mismatch(trainer, rollout, torch.zeros_like(mask)) == (0.0, 0.0, 0.0)


# --- the settings value and the registry of surrogates -------------------------------------------------------

# One row, two actions, A = +1: token ratios 2.0 (above 1 + HIGH) and 0.5 (below 1 - LOW), whose geometric mean
# is exactly 1. Each surrogate gives another number here, so a name mapped to the wrong surrogate shows.
SPLIT = [[2.0, 0.5]]
SPLIT_BY_HAND = {
    "ppo": (max(-2.0, -(1 + HIGH)) + max(-0.5, -(1 - LOW))) / 2,  # -0.89: each token clipped on its own
    "gspo": (-1.0 + -1.0) / 2,  # -1.0: the sequence ratio 1 is inside the bounds, on both tokens
    "cispo": (-(1 + HIGH) + -(1 - LOW)) / 2,  # -1.04: the weights clipped to 1.28 and 0.8
    "sapo": -(4 / (1 + math.exp(-1.0)) + 4 / (1 + math.exp(0.5))) / 2,  # -2.217: the gate at tau 1
}


def test_each_config_name_is_its_own_surrogate():
    from typing import get_args

    from kubealign.config.schema import PPOConfig
    from kubealign.rl.losses import SURROGATES

    assert set(get_args(PPOConfig.model_fields["policy_loss"].annotation)) == set(SURROGATES) == set(POLICY_LOSSES)
    assert len(set(SPLIT_BY_HAND.values())) == 4  # four different numbers: a swap of any two names changes one
    logprobs, old, adv, mask = rows(SPLIT, [1.0])
    log_ratio = torch.where(mask.bool(), logprobs - old, torch.zeros_like(logprobs))
    for name, expected in SPLIT_BY_HAND.items():
        per_token = SURROGATES[name](log_ratio, adv, mask, settings(name)).per_token.detach()
        assert float((per_token * mask).sum() / 2) == pytest.approx(expected, rel=1e-9), name
        assert policy_loss(logprobs, old, adv, mask, settings(name)).loss.item() == pytest.approx(expected), name


def test_policy_loss_reads_its_settings():
    """Each setting changed in the value alone changes the loss by what the hand computation says."""
    logprobs, old, adv, mask = rows(SPLIT, [1.0])
    base = policy_loss(logprobs, old, adv, mask, settings()).loss.item()
    assert base == pytest.approx(SPLIT_BY_HAND["ppo"])
    wider = policy_loss(logprobs, old, adv, mask, settings(cliprange_high=0.5)).loss.item()
    assert wider - base == pytest.approx((-1.5 - -(1 + HIGH)) / 2)  # the upper bound 1.5 instead of 1.28
    # the lower bound matters where A < 0: -A r = 2 and 0.5, the clip holds 0.5 at 1 - LOW = 0.8 ...
    pushed_down = policy_loss(logprobs, old, -adv, mask, settings()).loss.item()
    assert pushed_down == pytest.approx((2.0 + (1 - LOW)) / 2)
    # ... and with cliprange 0.6 (lower bound 0.4) 0.5 is inside: unclipped
    lower = policy_loss(logprobs, old, -adv, mask, PolicyLossSettings("ppo", 0.6, HIGH)).loss.item()
    assert lower - pushed_down == pytest.approx((0.5 - (1 - LOW)) / 2)
    symmetric = policy_loss(logprobs, old, adv, mask, PolicyLossSettings("ppo", LOW)).loss.item()
    assert symmetric == pytest.approx((-(1 + LOW) - 0.5) / 2)  # no cliprange_high: the upper bound 1 + cliprange
    constant = policy_loss(logprobs, old, adv, mask, settings(aggregation="constant", max_tokens=4)).loss.item()
    assert constant == pytest.approx(base * 2 / 4)  # the sum over 1 row x 4 tokens
    hotter = policy_loss(logprobs, old, adv, mask, settings("sapo", sapo_temperature_pos=2.0)).loss.item()
    assert hotter == pytest.approx(-(2 / (1 + math.exp(-2.0)) + 2 / (1 + math.exp(1.0))) / 2)  # 4 / tau, tau 2
    negative = policy_loss(logprobs, old, -adv, mask, settings("sapo", sapo_temperature_neg=2.0)).loss.item()
    assert negative == pytest.approx(-hotter)  # A = -1 takes the negative temperature


def test_the_settings_of_a_config_are_its_fields():
    from kubealign.config.schema import PPOConfig

    cfg = PPOConfig(
        policy_loss="cispo",
        cliprange=0.3,
        cliprange_high=0.4,
        loss_aggregation="sequence",
        max_new_tokens=9,
        sapo_temperature_pos=2.0,
        sapo_temperature_neg=3.0,
    )
    assert PolicyLossSettings.of(cfg) == PolicyLossSettings("cispo", 0.3, 0.4, "sequence", 9, 2.0, 3.0)
    assert PolicyLossSettings.of(cfg).clip_high == 0.4
    assert PolicyLossSettings.of(PPOConfig(cliprange=0.3)).clip_high == 0.3  # None: the symmetric clip


def test_an_unknown_policy_loss_name_is_refused_by_the_config_too():
    from pydantic import ValidationError

    from kubealign.config.schema import PPOConfig

    with pytest.raises(ValidationError, match="policy_loss"):
        PPOConfig(policy_loss="grpo")
