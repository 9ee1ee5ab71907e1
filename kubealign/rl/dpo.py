"""Direct Preference Optimization math: pure functions of tensors (Rafailov et al. 2023).

Shapes: B = pairs, T = sequence length, V = vocabulary. The sequence convention is the project's one
(kubealign.data.tokenize, kubealign.training.lm): prompt + response (+ one EOS unless the response was
cut for length), right-padded, and a `loss_mask` [B, T] that marks the response tokens as *targets*; the
logits at position t predict token t + 1 (kubealign.rl.losses.logprobs_from_logits), so loss_mask[:, 0] is
never used — exactly as the SFT loss (kubealign.training.losses.lm_loss) counts its tokens.

Log-ratios are h = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x)), and
  sigmoid (DPO eq. 7; cDPO with label smoothing eps):
      -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)
  ipo (Azar et al. 2023, eq. 17):  (h - 1 / (2 * beta))^2
For sigmoid the log-probs are sums over the response tokens; for ipo they are per-token means, as TRL's
DPOTrainer does (it divides the summed log-probs by the completion length when loss_type is "ipo"): IPO's
target margin 1/(2 beta) is then independent of the response length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kubealign.rl.losses import logprobs_from_logits


class SequenceLogprobs(NamedTuple):
    total: torch.Tensor  # [B] summed log-probability of the response tokens
    tokens: torch.Tensor  # [B] number of response tokens


class DPOLoss(NamedTuple):
    loss: torch.Tensor  # scalar, mean over pairs
    chosen_rewards: torch.Tensor  # [B] beta * (logp_c - ref_c), detached: the implicit reward (eq. 5)
    rejected_rewards: torch.Tensor  # [B] beta * (logp_r - ref_r), detached


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> SequenceLogprobs:
    """[B, T, V] logits, [B, T] ids and loss_mask -> per-sequence sums of the response tokens' log-probs.

    Any leading columns may be cut from all three alike (a forward that skips prompt-only columns): the
    result is the same as long as no masked token is cut."""
    return sequence_sums(logprobs_from_logits(logits, input_ids), loss_mask)


def sequence_sums(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> SequenceLogprobs:
    """[B, T-1] float32 log-probs of the next tokens (models.token_logprobs's, or logprobs_from_logits's)
    and [B, T] loss_mask -> per-sequence sums over the response tokens and their counts."""
    mask = loss_mask[:, 1:].float()
    return SequenceLogprobs((logprobs * mask).sum(-1), mask.sum(-1))


def pair_logprobs(seq: SequenceLogprobs, loss_type: str) -> torch.Tensor:
    """The log-prob DPO's loss takes: the sum (sigmoid) or the per-token mean (ipo, TRL's convention)."""
    if loss_type == "ipo":
        return seq.total / seq.tokens.clamp(min=1)
    return seq.total


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> DPOLoss:
    """DPO (eq. 7), cDPO (label_smoothing > 0) or IPO on [B] sequence log-probs (pair_logprobs); see the
    module docstring for the formulas. The reference terms carry no gradient."""
    chosen_ratio = policy_chosen.float() - ref_chosen.detach().float()
    rejected_ratio = policy_rejected.float() - ref_rejected.detach().float()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r} (expected sigmoid or ipo)")
    return DPOLoss(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def chosen_nll(chosen: SequenceLogprobs) -> torch.Tensor:
    """Mean NLL per chosen response token over the batch: RPO's added term (Pang et al. 2024, eq. 2; TRL's
    rpo_alpha), the SFT loss on the chosen responses, which keeps their likelihood from falling with the
    rejected ones' (DPO alone lowers both, and a small model then ends its answers early)."""
    return -chosen.total.sum() / chosen.tokens.sum().clamp(min=1)


def reward_metrics(out: DPOLoss, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict[str, float]:
    """TRL's DPO metrics, as means over the pairs: implicit rewards, accuracy (chosen reward strictly
    higher: a tie, as at step 0, counts as wrong), margin, and the policy's log-probs."""
    chosen, rejected = out.chosen_rewards, out.rejected_rewards
    return {
        "loss": float(out.loss.detach()),
        "rewards_chosen": float(chosen.mean()),
        "rewards_rejected": float(rejected.mean()),
        "rewards_accuracy": float((chosen > rejected).float().mean()),
        "rewards_margin": float((chosen - rejected).mean()),
        "logps_chosen": float(policy_chosen.detach().float().mean()),
        "logps_rejected": float(policy_rejected.detach().float().mean()),
    }


def token_kl(logits: torch.Tensor, ref_logits: torch.Tensor, loss_mask: torch.Tensor) -> SequenceLogprobs:
    """Exact KL(pi || ref) of the next-token distributions at each response position, summed per
    sequence: sum_t sum_v pi(v|.) (log pi(v|.) - log ref(v|.)) over the targets loss_mask marks (the same
    alignment as sequence_logprobs). [B, T, V] x 2, [B, T] -> ([B] nats, [B] tokens)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    ref_logp = F.log_softmax(ref_logits[:, :-1].float(), dim=-1)
    per_token = (logp.exp() * (logp - ref_logp)).sum(-1)
    mask = loss_mask[:, 1:].float()
    return SequenceLogprobs((per_token * mask).sum(-1), mask.sum(-1))
