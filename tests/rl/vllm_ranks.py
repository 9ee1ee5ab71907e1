"""Run by tests/rl/test_vllm_rollout.py under `torchrun --nproc_per_node 2`: each rank holds a ZeRO-3 actor (tiny
llama with seeded noise added, the same on both) and its own VLLMRollout inside the trainer's gloo group (vLLM's
external launcher), loads the actor's gathered weights, generates greedily for its own prompts and prints
whether the tokens equal HF generate's of the unpartitioned model; close() before the trainer's teardown."""

from __future__ import annotations

import copy

import torch

from kubealign.config.schema import SFTConfig
from kubealign.rl.vllm_rollout import VLLMRollout
from kubealign.training import distributed
from kubealign.training import engine as engines
from tests.rl.test_vllm_rollout import RolloutRequest, Settings, greedy, hf_greedy, hf_model, prompts, tiny


def main() -> None:
    from transformers import AutoTokenizer

    rank, world = distributed.init()
    path = tiny.ensure("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = hf_model(path)
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    cfg = SFTConfig(zero_stage=3, micro_batch_size=2, learning_rate=1e-3, lr_scheduler="constant")
    actor = engines.create(copy.deepcopy(model), cfg, engines.ds_config(cfg, world, cuda=False), total_steps=1)
    partitioned = all(p.numel() == 0 for p in actor.module.parameters())
    rollout = VLLMRollout(str(path), tokenizer, "float32", seed=0, settings=Settings())
    rollout.load_weights(actor.module)
    every = prompts(tokenizer)
    mine = RolloutRequest(every.prompt_ids[rank::world], every.prompt_attention_mask[rank::world])
    equal = torch.equal(rollout.generate(mine, greedy()).input_ids, hf_greedy(model, tokenizer, mine, 24))
    print(f"rank {rank} of {world}: partitioned {partitioned}, greedy equal {equal}", flush=True)
    rollout.close()
    distributed.shutdown(True)


if __name__ == "__main__":
    main()
