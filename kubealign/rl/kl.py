"""KL-penalty coefficient controllers: fixed beta, or adaptive (Ziegler et al. 2019, sec. 2.2).

The adaptive controller moves beta so that the measured KL to the reference tracks a target:
    e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n / horizon)
where n is the number of samples in the batch that measured KL. Its state is one float, saved in
PPO checkpoints so a resumed run continues with the same beta.
"""

from __future__ import annotations


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
