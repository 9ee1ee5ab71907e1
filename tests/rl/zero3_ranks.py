"""Run by tests/rl/test_zero3_finish_apart.py under `torchrun --nproc_per_node 2`: ranks that finish generating
apart, with the actor at ZeRO-3 (each decode forward all-gathers the partitioned weights, a collective every rank
must join). Rank 0's rows sample EOS at their 1st token, rank 1's at their 6th (a forward hook forces it), in one
single-turn rollout (`single`) and in a multi-turn one (`multi`: an environment that ends rank 0's trajectories
after one turn, rank 1's after three). Each rank prints its forward count and the turns its trajectories took;
a rank left waiting in an all-gather that the other never joins hangs, which the test's timeout catches."""

from __future__ import annotations

import copy
import sys

import torch

from kubealign.config.schema import PPOConfig, SFTConfig
from kubealign.config.tools import ToolsConfig
from kubealign.models import loading, tiny
from kubealign.rl import multiturn
from kubealign.rl import rollout as rl_rollout
from kubealign.training import distributed
from kubealign.training import engine as engines

ENDS = {0: 0, 1: 5}  # the decode step at which each rank's rows sample EOS (0: the first token)
TURNS = {0: 1, 1: 3}  # the turns the environment gives each rank's trajectories


class Environment:
    """The reward-function worker's environment calls, standing in: every step ends a trajectory once it has had
    this rank's TURNS."""

    def __init__(self, turns: int):
        self.turns, self.taken = turns, {}

    def environment(self, call: str, payload: dict, origins: list) -> dict:
        if call == "reset":
            return {"observations": ["" for _ in payload["slots"]]}
        steps = []
        for slot in payload["slots"]:
            self.taken[slot] = self.taken.get(slot, 0) + 1
            steps.append({"reward": 1.0, "observation": " ok", "done": self.taken[slot] >= self.turns})
        return {"steps": steps}


def force_eos(module: torch.nn.Module, end: int, eos: int, forwards: list[int]) -> None:
    """Every forward counted; from decode step END on (the prefill is step 0) each row's next token is EOS."""

    def hook(_module, _inputs, output):
        forwards.append(output.logits.shape[1])
        if len(forwards) > end:
            output.logits[:, -1, eos] = 1e4
        return output

    module.register_forward_hook(hook)


def main(case: str) -> None:
    rank, world = distributed.init()
    path = tiny.ensure("opt")
    tokenizer = loading.load_tokenizer(str(path))
    model = loading.load_causal_lm(str(path))
    cfg = SFTConfig(zero_stage=3, micro_batch_size=2, learning_rate=1e-3, lr_scheduler="constant")
    actor = engines.create(copy.deepcopy(model), cfg, engines.ds_config(cfg, world, cuda=False), total_steps=1)
    partitioned = all(p.numel() == 0 for p in actor.module.parameters())
    forwards: list[int] = []
    force_eos(actor.module, ENDS[rank], tokenizer.eos_token_id, forwards)
    synced = world > 1  # what ppo_models.build_models sets: several ranks, actor at ZeRO-3
    rollout = rl_rollout.ModuleRollout(actor, tokenizer, synced_gpus=synced)
    models = rl_rollout.PPOModels(actor, None, None, None, rollout, tokenizer, synced)
    ppo = PPOConfig(max_new_tokens=8, generation_batch_size=2)
    prompts = [tokenizer("hello there", add_special_tokens=False).input_ids, [5, 6, 7][: 2 + rank]]
    ids, mask = multiturn.left_padded(prompts, tokenizer.pad_token_id)
    turns = [1, 1]
    if case == "single":
        rl_rollout.generate(models, ids, mask, ppo)
    else:
        env = Environment(TURNS[rank])
        session = multiturn.ToolSession(ToolsConfig(environment="env.py:Env", max_turns=4), env, tokenizer)
        batch = multiturn.rollout(models, ids, mask, ppo, session)
        turns = batch.turns.tolist()
    print(f"rank {rank} of {world}: partitioned {partitioned}, forwards {len(forwards)}, turns {turns}", flush=True)
    distributed.shutdown(True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "single")
