"""The PPO-ptx term's data (InstructGPT eq. 2, gamma: ppo.unsup_coef): phase-1 (prompt, chosen) sequences
served micro-batch by micro-batch beside each policy update, and their language-modelling loss on the actor,
which keeps the policy near the pretraining / SFT distribution."""

from __future__ import annotations

from typing import Any

import torch


class UnsupervisedData:
    """Phase-1 (prompt, chosen) sequences for the PPO-ptx term, served micro-batch by micro-batch in a
    fixed cyclic order (a function of the number of batches served, so resume needs no extra state).
    Each rank serves its own slice of every round, so world ranks see world different batches."""

    def __init__(
        self, examples: list[dict[str, list[int]]], batch_size: int, pad_id: int, served: int = 0, rank=0, world=1
    ):
        self.examples, self.batch_size, self.pad_id, self.served = examples, batch_size, pad_id, served
        self.rank, self.world = rank, world

    def next_chunk(self) -> list[dict[str, list[int]]]:
        start = (self.served * self.world + self.rank) * self.batch_size
        self.served += 1
        return [self.examples[(start + i) % len(self.examples)] for i in range(self.batch_size)]

    def loss(self, actor: Any) -> torch.Tensor:
        from kubealign.training.lm import batch_loss, collate

        return batch_loss(actor, collate(self.next_chunk(), self.pad_id), fp32=True).loss
