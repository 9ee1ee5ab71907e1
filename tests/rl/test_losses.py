"""Loss and score math against hand-computed values, invariances and equivalences."""

from __future__ import annotations

import math

import torch

from kubealign.models.inputs import position_ids
from kubealign.models.value_head import last_token_scores
from kubealign.training.losses import bradley_terry_loss, lm_loss


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617; -log sigmoid(0) = log 2 = 0.6931472
    expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 2
    assert abs(bradley_terry_loss(chosen, rejected).item() - expected) < 1e-6
    assert bradley_terry_loss(torch.tensor([10.0]), torch.tensor([-10.0])).item() < 1e-8


def test_last_token_scores_right_and_left_padding():
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [5.0, 6.0, 9.0, 9.0], [9.0, 9.0, 7.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]])
    assert last_token_scores(values, mask).tolist() == [3.0, 6.0, 8.0]


def test_position_ids_ignore_padding():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    assert position_ids(mask).tolist() == [[0, 1, 2, 2], [0, 0, 0, 1]]


def test_lm_loss_by_hand_and_masked_positions_do_not_matter():
    # Vocabulary of 2, uniform logits: every predicted token costs log 2.
    logits = torch.zeros(1, 4, 2)
    ids = torch.tensor([[0, 1, 0, 1]])
    mask = torch.tensor([[0, 0, 1, 1]])
    out = lm_loss(logits, ids, mask)
    assert abs(out.loss.item() - math.log(2)) < 1e-6
    assert out.tokens.item() == 2 and abs(out.nll_sum.item() - 2 * math.log(2)) < 1e-6
    # Change the logits that predict the masked-out target (position 0 -> token 1): loss unchanged.
    changed = logits.clone()
    changed[0, 0] = torch.tensor([5.0, -5.0])
    assert torch.allclose(lm_loss(changed, ids, mask).loss, out.loss)
    # A confident correct prediction on a counted target lowers it: target ids[0,2]=0 from logits[0,1].
    better = logits.clone()
    better[0, 1] = torch.tensor([5.0, -5.0])
    expected = (math.log(1 + math.exp(-10)) + math.log(2)) / 2
    assert abs(lm_loss(better, ids, mask).loss.item() - expected) < 1e-6


def test_lm_loss_matches_a_loop():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 6, 11), torch.randint(0, 11, (3, 6))
    mask = torch.randint(0, 2, (3, 6))
    total, count = 0.0, 0
    for b in range(3):
        for t in range(1, 6):
            if mask[b, t]:
                total -= torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]].item()
                count += 1
    assert abs(lm_loss(logits, ids, mask).loss.item() - total / count) < 1e-5


def test_lm_loss_of_one_counted_token_and_upcasts_by_default():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    ids, mask = torch.tensor([[0, 2]]), torch.tensor([[0, 1]])
    expected = -torch.log_softmax(logits[0, 0], -1)[2].item()
    assert abs(lm_loss(logits, ids, mask).loss.item() - expected) < 1e-6  # one token: the mean is its NLL
    half = logits.to(torch.bfloat16)
    exact = lm_loss(half.float(), ids, mask).loss.item()
    assert lm_loss(half, ids, mask).loss.dtype == torch.float32
    assert abs(lm_loss(half, ids, mask).loss.item() - exact) < 1e-6
