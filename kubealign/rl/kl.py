"""KL-penalty coefficient controllers: fixed beta, or adaptive (Ziegler et al. 2019, sec. 2.2); the k3
KL estimator of GRPO's loss term.

The adaptive controller moves beta so that the measured KL to the reference tracks a target:
    e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n / horizon)
where n is the number of samples in the batch that measured KL. Its state is one float, saved in
PPO checkpoints so a resumed run continues with the same beta.
"""

from __future__ import annotations

import torch


class KLController:
    """beta fixed (target None) or adaptive (target and horizon set)."""

    def __init__(self, init_coef: float, target: float | None = None, horizon: int = 10000):
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> float:
        """Update beta from the KL measured on n_samples; returns the new beta."""
        if self.target is not None:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# k3's bounds, veRL's (kl_penalty "low_var_kl"): the log-ratio is clamped to at most 20 before exp, the
# estimate to at most 10 per token. Unclamped, one token the updated policy gives a probability near 0
# makes exp(ref - logp) overflow to inf (and inf - inf = nan, or 0 * inf = nan in the backward); clamped,
# that token's term is a large finite penalty with no gradient past the bound, and the rest of the batch
# still trains. veRL also clamps the log-ratio at -20; that bound never binds here: the estimate reaches
# the cap of 10 already at a log-ratio of about -11, and exp(d) - d - 1 is finite down to d = -inf.
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, A] per-token estimate of KL(pi || pi_ref) from tokens sampled by pi:
        exp(d) - d - 1,   d = min(ref - logp, 20),   then at most 10
    (Schulman 2020, "Approximating KL divergence"; DeepSeekMath eq. 4; the bounds are veRL's, see
    K3_BOUND): >= 0 for every token, 0 where the two log-probs agree and outside the response, finite
    always — also where a log-prob is -inf (two -inf agree: 0)."""
    delta = torch.where(response_mask.bool(), ref_logprobs - logprobs, torch.zeros_like(logprobs))
    delta = torch.nan_to_num(delta).clamp(max=K3_LOG_RATIO_BOUND)  # nan (two -inf agree) -> 0; +-inf -> finite
    return (delta.exp() - delta - 1).clamp(max=K3_BOUND)
