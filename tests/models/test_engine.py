"""The DeepSpeed engine of a training stage on CPU (issue 15): torch's fused AdamW kernel, and no gradient
all-reduce at ZeRO 0 on one rank — where it would only copy every gradient into a bucket and back."""

from __future__ import annotations

import pytest
import torch

from kubealign.config.schema import SFTConfig
from kubealign.training import engine as engines


def test_the_cpu_optimizer_is_torchs_fused_adamw_and_cuda_keeps_deepspeeds():
    cfg = SFTConfig(learning_rate=3e-4, weight_decay=0.01)
    cpu = engines.ds_config(cfg, 1, cuda=False)["optimizer"]["params"]
    assert cpu["torch_adam"] is True and cpu["fused"] is True
    cuda = engines.ds_config(cfg, 1, cuda=True)["optimizer"]["params"]
    assert cuda["torch_adam"] is False and "fused" not in cuda  # DeepSpeed's own FusedAdam there


def tiny_engine(stage: int, allreduce: bool | None = None):
    from transformers import OPTConfig, OPTForCausalLM

    from kubealign.training import distributed

    distributed.init()
    config = OPTConfig(
        vocab_size=32,
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=16,
        max_position_embeddings=32,
        dropout=0.0,
    )
    torch.manual_seed(0)
    model = OPTForCausalLM(config)
    cfg = SFTConfig(learning_rate=1e-2, weight_decay=0.1, zero_stage=stage, micro_batch_size=2, lr_scheduler="constant")
    engine = engines.create(model, cfg, engines.ds_config(cfg, 1, cuda=False), total_steps=3)
    if allreduce is not None:
        engine.enable_backward_allreduce = allreduce
    return engine


def train(engine, steps: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[0, 5, 9, 3, 7, 2], [0, 11, 4, 4, 2, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    for _ in range(steps):
        loss = engine(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        engine.backward(loss)
        engine.step()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.integration
def test_one_rank_at_zero0_skips_the_all_reduce_and_trains_bit_for_bit_as_with_it():
    skipped = tiny_engine(0)
    assert skipped.enable_backward_allreduce is False
    assert type(skipped.optimizer) is torch.optim.AdamW and skipped.optimizer.defaults["fused"] is True
    with_it = tiny_engine(0, allreduce=True)
    after, reference = train(skipped), train(with_it)
    start = tiny_engine(0).module.state_dict()
    assert any(not torch.equal(after[k], start[k]) for k in after)  # it trained
    for key, value in after.items():
        assert torch.equal(value, reference[key]), key


@pytest.mark.integration
def test_zero1_keeps_its_gradient_reduction():
    # ZeRO >= 1 moves gradients into its partitions in that step: skipping it would train nothing
    assert tiny_engine(1).enable_backward_allreduce is True
