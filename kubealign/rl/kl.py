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


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, A] per-token estimate of KL(pi || pi_ref) from tokens sampled by pi:
        exp(ref - logp) - (ref - logp) - 1
    (Schulman 2020, "Approximating KL divergence"; DeepSeekMath eq. 4): unbiased, >= 0 for every token,
    0 where the two log-probs agree; 0 outside the response (also where a prompt log-prob is -inf)."""
    delta = torch.where(response_mask.bool(), ref_logprobs - logprobs, torch.zeros_like(logprobs))
    return delta.exp() - delta - 1
