"""The ppo stage's checkpoint: actor, critic and the actor's EMA of one iteration, sealed together under
one `latest` (kubealign.training.checkpoints), with the KL controller, the RNG and the data position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kubealign import ranks
from kubealign.errors import UserError
from kubealign.rl.kl import KLController
from kubealign.rl.rollout import PPOModels
from kubealign.training import checkpoints, distributed, export

STAGE = "ppo"


class EMA:
    """Exponential moving average of the actor's (gathered) parameters, kept on CPU."""

    def __init__(self, coef: float):
        self.coef = coef
        self.state: dict[str, torch.Tensor] = {}

    def update(self, module: torch.nn.Module) -> None:
        current, _ = export.gather_state(module, keep=True)
        for name, value in current.items():
            value = value.float()
            previous = self.state.get(name)
            self.state[name] = value if previous is None else self.coef * previous + (1 - self.coef) * value


EMA_FILE = "kubealign-ema.pt"


def checkpoint_parts(directory: Path, models: PPOModels) -> list[Path]:
    """The directories one PPO iteration's checkpoint spans (each with ITER/kubealign-sha256.json)."""
    return [directory / "actor"] + ([directory / "critic"] if models.critic is not None else [])


def save_checkpoint(models: PPOModels, directory: Path, step: int, kl: KLController, ema: EMA | None, extra: dict):
    """The actor (with the EMA inside its tag), the critic, each sealed, then ONE `latest` for all of them
    (DIRECTORY/latest, checkpoints.commit): a kill anywhere before it leaves the previous iteration's."""
    tag = f"iter{step}"
    state = {"iteration": step, "rng": distributed.rng_state(), "kl": kl.state_dict(), **extra}
    with checkpoints.saving(directory, tag, STAGE, checkpoint_parts(directory, models)):
        models.actor.save_checkpoint(str(directory / "actor"), tag=tag, client_state=state, save_latest=False)
        if models.critic is not None:
            models.critic.save_checkpoint(str(directory / "critic"), tag=tag, save_latest=False)
        if ema is not None and ranks.is_main():
            torch.save(ema.state, directory / "actor" / tag / EMA_FILE)  # inside the tag: sealed with it
        for part in checkpoint_parts(directory, models):
            checkpoints.seal(part, tag)
    checkpoints.commit(directory, tag)
    distributed.set_rng_state(state["rng"])


def load_checkpoint(
    models: PPOModels, directory: Path, kl: KLController, ema: EMA | None, algorithm: str = "ppo"
) -> dict[str, Any]:
    """The iteration every part sealed (checkpoints.resume_tag over actor and critic): never an actor of one
    iteration with a critic of another."""
    tag = checkpoints.resume_tag(directory, checkpoint_parts(directory, models))
    if tag is None:
        return {"iteration": 0}
    state = checkpoints.load(models.actor, directory / "actor", tag)
    saved = state.get("algorithm", "ppo")  # checkpoints from before ppo.algorithm existed are ppo's
    if saved != algorithm:  # the advantages (and the critic's presence) would change mid-run
        raise UserError(
            f"--resume: the checkpoints in {directory} are of ppo.algorithm {saved}, this run is {algorithm}"
        )
    if models.critic is not None:
        checkpoints.load(models.critic, directory / "critic", tag)
    distributed.set_rng_state(state["rng"])
    kl.load_state_dict(state["kl"])
    if ema is not None:
        ema_file = directory / "actor" / tag / EMA_FILE
        if not ema_file.is_file():
            raise UserError(f"--resume: {ema_file} is missing: the checkpoint was saved without ppo.ema_coef")
        ema.state = torch.load(ema_file, weights_only=True)  # tensors only: no pickled code
    return state
