"""The target tokens' log-probs with the LM head at the loss positions only (issue 56) equal the full-logits
path's to float32 rounding — values, entropies and gradients — on OPT (with project_out), LLaMA, GPT-2, a PEFT
LoRA wrapper and a DeepSpeed engine, whatever the chunk size; the stages' losses built on it (SFT, DPO, PPO's
passes) equal the old ones; an unknown model takes the full-logits path, noted once."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kubealign.models import token_logprobs as tl
from kubealign.models.inputs import position_ids
from kubealign.models.token_logprobs import Settings, target_logprobs
from tests.support.models import DoubledLogits

V, PAD, EOS = 61, 1, 2
EXACT = 1e-5  # float32: a matmul of other shapes rounds otherwise


def small_config(model_type: str, **extra):
    """A 2-layer causal LM config of this architecture, width 32, vocabulary V, no dropout."""
    from transformers import AutoConfig

    ids = {"vocab_size": V, "pad_token_id": PAD, "bos_token_id": 0, "eos_token_id": EOS}
    if model_type == "opt":  # word_embed_proj_dim != hidden_size: project_in / project_out exist
        shape = {"hidden_size": 32, "word_embed_proj_dim": 16, "ffn_dim": 64, "num_attention_heads": 2}
        shape.update(num_hidden_layers=2, dropout=0.0, max_position_embeddings=64)
    elif model_type == "gpt2":
        shape = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.0}
        shape.update(embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
        shape.update(num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    return AutoConfig.for_model(model_type, **ids, **shape, **extra)


def small_lm(model_type: str, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(small_config(model_type, **extra)).train()


def batch(seed: int = 0):
    """(input_ids, attention_mask, loss_mask) [3, 14]: prompts of 3, 8 and 2 tokens, right padding of 4, 0 and
    6, an EOS inside row 1's prompt (a target nowhere), the responses the targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 14), generator=g)
    attention, loss = torch.ones_like(ids), torch.zeros_like(ids)
    for row, (prompt, length) in enumerate([(3, 10), (8, 14), (2, 8)]):
        ids[row, length:], attention[row, length:] = PAD, 0
        loss[row, prompt:length] = 1
    ids[1, 4] = EOS
    return ids, attention, loss


def full_path(model, ids, attention, loss, temperature=1.0):
    """What the stages computed before issue 56: every position's logits, one float32 log-softmax."""
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids(attention), use_cache=False
    ).logits
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    mask = loss[:, 1:].bool()
    logprobs = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(logprobs)
    return torch.where(mask, logprobs, zero), torch.where(mask, entropy, zero)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def objective(logprobs, entropy, loss):
    """A loss that weighs every target differently (a mean would hide a permuted scatter)."""
    weights = torch.arange(1, loss.shape[1], dtype=torch.float32)
    return (logprobs * weights).sum() + 0.3 * (entropy * weights.flip(0)).sum()


def assert_same(model, settings: Settings, seed: int = 0):
    ids, attention, loss = batch(seed)
    want_lp, want_ent = full_path(model, ids, attention, loss, settings.temperature)
    objective(want_lp, want_ent, loss).backward()
    want = grads(model)
    got = target_logprobs(model, ids, attention, loss[:, 1:], settings)
    assert torch.allclose(got.logprobs, want_lp, atol=EXACT, rtol=0)
    assert torch.allclose(got.entropy, want_ent, atol=EXACT, rtol=0)
    assert (got.logprobs[~loss[:, 1:].bool()] == 0).all() and (got.logprobs[loss[:, 1:].bool()] < 0).all()
    objective(got.logprobs, got.entropy, loss).backward()
    have = grads(model)
    assert want.keys() == have.keys() and len(have) > 4
    for name, value in want.items():
        assert torch.allclose(have[name], value, atol=EXACT, rtol=1e-4), name
    return got


@pytest.mark.parametrize("model_type", ["opt", "llama", "gpt2"])
@pytest.mark.parametrize("chunk", [3, 1024])  # 3: fewer positions than the batch's 19 targets, not dividing them
def test_values_entropies_and_gradients_equal_the_full_logits(model_type, chunk, caplog):
    model = small_lm(model_type)
    assert not isinstance(tl.head_parts(model), str)  # the gathered path, not the fallback
    with caplog.at_level(logging.WARNING, logger=tl.__name__):
        assert_same(model, Settings(temperature=0.7, entropy=True, entropy_grad=True, chunk_size=chunk))
    assert not caplog.records


def test_the_head_sees_only_the_targets_in_chunks():
    model = small_lm("opt")
    ids, attention, loss = batch()
    assert int(loss[:, 1:].sum()) == 19
    for chunk, want in ((5, [5, 5, 5, 4, 4, 5, 5, 5]), (19, [19]), (1024, [19])):
        seen: list[int] = []
        head = model.get_output_embeddings()
        handle = head.register_forward_hook(lambda _m, args, _o, seen=seen: seen.append(args[0].shape[0]))
        target_logprobs(model, ids, attention, loss[:, 1:], Settings(chunk_size=chunk)).logprobs.sum().backward()
        handle.remove()
        # several chunks: each runs again, last first, in the backward pass (recomputed, not kept); one: kept
        assert seen == want, chunk


def test_no_target_gives_zeros_and_a_loss_that_backpropagates():
    model = small_lm("llama")
    ids, attention, _ = batch()
    out = target_logprobs(model, ids, attention, torch.zeros(3, 13, dtype=torch.bool))
    assert out.entropy is None and out.logprobs.shape == (3, 13) and (out.logprobs == 0).all()
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and (model.lm_head.weight.grad == 0).all()


def test_entropy_without_grad_is_logged_not_differentiated():
    model = small_lm("opt")
    ids, attention, loss = batch()
    out = target_logprobs(model, ids, attention, loss[:, 1:], Settings(entropy=True, chunk_size=4))
    assert out.logprobs.requires_grad and not out.entropy.requires_grad
    assert torch.allclose(out.entropy, full_path(model, ids, attention, loss)[1], atol=EXACT, rtol=0)


def test_a_bf16_model_gets_float32_log_probs_unless_told_otherwise():
    model = small_lm("opt").to(torch.bfloat16).eval()
    ids, attention, loss = batch()
    with torch.no_grad():
        upcast = target_logprobs(model, ids, attention, loss[:, 1:]).logprobs
        native = target_logprobs(model, ids, attention, loss[:, 1:], Settings(fp32=False)).logprobs
        want = full_path(model, ids, attention, loss)[0]
    assert upcast.dtype == torch.float32 and native.dtype == torch.bfloat16
    assert torch.allclose(upcast, want, atol=1e-2, rtol=0)  # bf16 logits, a float32 log-softmax both
    assert not torch.equal(upcast, native.float())  # the log-softmax in bf16 rounds otherwise


@pytest.mark.parametrize("model_type", sorted(tl.FAST_TYPES - {"opt", "gpt2"}))
def test_every_architecture_taken_computes_its_own_logits(model_type):
    """FAST_TYPES lists architectures whose logits are lm_head(decoder(...)): each is checked here."""
    model = small_lm(model_type).eval()
    ids, attention, loss = batch(1)
    with torch.no_grad():
        got = target_logprobs(model, ids, attention, loss[:, 1:], Settings(chunk_size=7)).logprobs
        want = full_path(model, ids, attention, loss)[0]
    assert not isinstance(tl.head_parts(model), str)
    assert torch.allclose(got, want, atol=EXACT, rtol=0)


def test_a_lora_wrapper_trains_its_adapters_through_the_gathered_path():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(small_lm("opt"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, param in model.named_parameters():  # non-zero B: the adapters change the log-probs
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    assert not isinstance(tl.head_parts(model), str)
    assert_same(model, Settings(entropy=True, entropy_grad=True, chunk_size=3))
    with model.disable_adapter():  # DPO's LoRA reference: the same module with its adapters off
        ids, attention, loss = batch()
        with torch.no_grad():
            off = target_logprobs(model, ids, attention, loss[:, 1:]).logprobs
            assert torch.allclose(off, full_path(model, ids, attention, loss)[0], atol=EXACT, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(off, target_logprobs(model, ids, attention, loss[:, 1:]).logprobs, atol=1e-3)


def test_an_unknown_model_takes_the_full_logits_noted_once(caplog, monkeypatch):
    monkeypatch.setattr(tl, "_NOTED", set())
    model = DoubledLogits(small_lm("opt"))
    ids, attention, loss = batch()
    with caplog.at_level(logging.WARNING, logger=tl.__name__):
        first = target_logprobs(model, ids, attention, loss[:, 1:], Settings(entropy=True, chunk_size=4))
        again = target_logprobs(model, ids, attention, loss[:, 1:])
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "full logits" in notes[0] and "DoubledLogits" in notes[0]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention)).logits
    want = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * loss[:, 1:]
    assert torch.allclose(first.logprobs, want, atol=EXACT, rtol=0) and torch.equal(first.logprobs, again.logprobs)
    first.logprobs.sum().backward()  # gradients flow through the fallback too
    assert model.inner.lm_head.weight.grad is not None


def test_soft_capped_or_scaled_logits_take_the_full_logits(caplog, monkeypatch):
    monkeypatch.setattr(tl, "_NOTED", set())
    model = small_lm("llama", final_logit_softcapping=30.0)
    reason = tl.head_parts(model)
    assert isinstance(reason, str) and "final_logit_softcapping=30.0" in reason
    with caplog.at_level(logging.WARNING, logger=tl.__name__):
        assert_same(model, Settings(entropy=True, entropy_grad=True, chunk_size=3))  # (llama ignores the cap)
    assert len(caplog.records) == 1


def test_sft_loss_equals_lm_loss_on_the_full_logits():
    from kubealign.training.lm import batch_loss
    from kubealign.training.losses import lm_loss

    model = small_lm("opt")
    ids, attention, loss = batch()
    full = lm_loss(
        model(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention)).logits, ids, loss
    )
    full.loss.backward()
    want = grads(model)
    out = batch_loss(model, {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}, fp32=True)
    assert int(out.tokens) == 19 and torch.allclose(out.nll_sum, full.nll_sum, atol=1e-4, rtol=0)
    assert torch.allclose(out.loss, full.loss, atol=EXACT, rtol=0)
    out.loss.backward()
    for name, value in grads(model).items():
        assert torch.allclose(value, want[name], atol=EXACT, rtol=1e-4), name


def test_dpo_sequence_logprobs_equal_the_full_logits_and_give_ln2():
    from kubealign.rl.dpo import dpo_loss, sequence_logprobs
    from kubealign.stages.dpo import halves, response_logprobs

    model = small_lm("llama")
    ids, attention, loss = batch()
    ids, attention, loss = (torch.cat([x, x.roll(1, 0)]) for x in (ids, attention, loss))  # 3 pairs
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention)).logits
    want = sequence_logprobs(logits, ids, loss)
    got = response_logprobs(model, {"input_ids": ids, "attention_mask": attention, "loss_mask": loss})
    assert torch.allclose(got.total, want.total, atol=1e-4, rtol=0) and torch.equal(got.tokens, want.tokens)
    (pc, pr), (rc, rr) = halves(got, "sigmoid"), halves(got, "sigmoid")
    assert torch.allclose(dpo_loss(pc, pr, rc.detach(), rr.detach(), 0.1).loss, torch.tensor(0.6931472))


@pytest.mark.integration
@pytest.mark.parametrize("stage", [0, 3])
def test_a_deepspeed_engine_trains_as_on_the_full_logits(stage):
    """Two SFT steps on a DeepSpeed engine through lm.batch_loss (the gathered path inside the engine's own
    forward) give the weights two steps through lm_loss on the full logits give."""
    from kubealign.config.schema import SFTConfig
    from kubealign.training import distributed
    from kubealign.training import engine as engines
    from kubealign.training.lm import batch_loss
    from kubealign.training.losses import lm_loss

    distributed.init()
    ids, attention, loss = batch()
    collated = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}
    cfg = SFTConfig(learning_rate=1e-2, zero_stage=stage, micro_batch_size=3, lr_scheduler="constant")

    def trained(gathered: bool) -> dict[str, torch.Tensor]:
        engine = engines.create(small_lm("opt"), cfg, engines.ds_config(cfg, 1, cuda=False), total_steps=2)
        for _ in range(2):
            if gathered:
                out = batch_loss(engine, collated, fp32=True)
            else:
                logits = engine(input_ids=ids, attention_mask=attention, position_ids=position_ids(attention)).logits
                out = lm_loss(logits, ids, loss)
            engine.backward(out.loss)
            engine.step()
        return engines_state(engine)

    new, old, start = trained(True), trained(False), small_lm("opt").state_dict()
    assert any(not torch.allclose(new[k], start[k]) for k in new)  # it trained
    for name, value in old.items():
        assert torch.allclose(new[name], value, atol=1e-5, rtol=1e-4), name


def engines_state(engine) -> dict[str, torch.Tensor]:
    """The engine's weights, gathered under ZeRO-3."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
