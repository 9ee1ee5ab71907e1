"""The PPO loop's speed paths (issue 15) do the same math as before: the entropy enters autograd only
when the loss uses it, rollouts stop once every row has ended (same sequences and masks, fewer forwards),
and the cheaper sampling setup draws the same samples under a fixed seed as the old one."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from kubealign.config.schema import PPOConfig
from kubealign.models.token_logprobs import forward_logits
from kubealign.rewards.scorer import Scorer
from kubealign.rl import iteration
from kubealign.rl import rollout as rl_rollout
from kubealign.rl.advantages import masked_mean
from kubealign.rl.experience import make_experience, response_masks, response_only
from kubealign.rl.losses import (
    PolicyLossSettings,
    Sampling,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    scaled_logits,
)
from kubealign.rl.rollout import PPOModels, generation_config
from tests.rl.test_experience import TableLM, TokenValue

PAD, EOS, BOS = 1, 2, 0


# --- entropy: no gradient work the loss does not use ---------------------------------------------------


def random_experience(sampling: Sampling, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(6, 6, generator=g)
    ids = torch.randint(3, 6, (4, 7), generator=g)
    ids[0, :2] = PAD
    for t in range(3, 7):  # responses the sampler could draw (inside any top-k / nucleus): greedy ones
        ids[:, t] = (table[ids[:, t - 1]] + 0.01 * torch.arange(6)).argmax(-1)
    ids[1, 5] = EOS  # row 1's response ends early: the rest is padding
    batch = SimpleNamespace(input_ids=ids, response_start_idx=torch.full((4,), 3))
    prompt_mask = (ids[:, :3] != PAD).long()
    actor = TableLM(table)
    exp = make_experience(
        batch,
        prompt_mask,
        EOS,
        PPOModels(actor, TokenValue(), TableLM(table), Scorer(TokenValue(), 1.0, None, None), None, None),
        sampling,
    )
    exp = exp._replace(logprobs=exp.logprobs - 0.1 * torch.rand(exp.logprobs.shape, generator=g))  # ratio != 1
    advantages = torch.randn(exp.logprobs.shape, generator=g)
    return actor, exp, advantages


def old_actor_loss(actor, exp, idx, advantages, cfg):
    """The update's actor loss as 892bdca computed it: a second log-softmax for the entropy, in autograd."""
    ids, mask, resp = exp.input_ids[idx], exp.attention_mask[idx], exp.response_mask[idx]
    logits = scaled_logits(forward_logits(actor, ids, mask), Sampling.of(cfg))
    logprobs = response_only(logprobs_from_logits(logits, ids), resp)
    entropy = response_only(entropy_from_logits(logits), resp)
    pl = policy_loss(logprobs, exp.logprobs[idx], advantages[idx], resp, PolicyLossSettings(cliprange=cfg.cliprange))
    mean_entropy = masked_mean(entropy, resp)
    return pl.loss - cfg.entropy_coef * mean_entropy, mean_entropy


def grad_of(actor, loss):
    actor.table.grad = None
    loss.backward()
    return actor.table.grad.clone()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.7, 3, 0.9)], ids=["plain", "truncated"])
def test_entropy_coef_zero_gives_bit_identical_loss_and_gradients_and_the_same_logged_entropy(sampling):
    actor, exp, advantages = random_experience(sampling)
    cfg = PPOConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    assert cfg.entropy_coef == 0
    idx = torch.tensor([2, 0, 1])
    old_loss, old_entropy = old_actor_loss(actor, exp, idx, advantages, cfg)
    old_grad = grad_of(actor, old_loss)
    inputs = iteration.UpdateInputs(exp, advantages)
    _, entropy, loss, _ = iteration.actor_objective(actor, inputs, idx, cfg, PolicyLossSettings.of(cfg))
    assert not entropy.requires_grad  # logged only: nothing of it in the backward graph
    assert torch.equal(loss, old_loss)
    assert torch.equal(grad_of(actor, loss), old_grad)
    # The logged entropy is the tempered distribution's, computed explicitly: -sum p log p per action.
    resp = exp.response_mask[idx].bool()
    logp = scaled_logits(actor.table.detach()[exp.input_ids[idx][:, :-1]], sampling).log_softmax(-1)
    by_hand = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)[resp].mean()
    assert entropy.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert entropy.item() == pytest.approx(old_entropy.item(), rel=1e-6)


def test_a_positive_entropy_coef_puts_the_entropy_in_the_gradient():
    actor, exp, advantages = random_experience(Sampling())
    idx = torch.arange(4)
    cfg = PPOConfig(entropy_coef=0.1)
    old_loss, _ = old_actor_loss(actor, exp, idx, advantages, cfg)
    old_grad = grad_of(actor, old_loss)
    inputs = iteration.UpdateInputs(exp, advantages)
    pl, entropy, loss, _ = iteration.actor_objective(actor, inputs, idx, cfg, PolicyLossSettings.of(cfg))
    assert entropy.requires_grad
    assert loss.item() == pytest.approx((pl.loss - 0.1 * entropy).item())
    new_grad = grad_of(actor, loss)
    assert torch.allclose(new_grad, old_grad, atol=1e-7)
    _, _, without, _ = iteration.actor_objective(actor, inputs, idx, PPOConfig(), PolicyLossSettings.of(PPOConfig()))
    assert not torch.allclose(grad_of(actor, without), new_grad, atol=1e-4)  # the entropy term is in it


# --- rollouts: stop when every row has ended; the same samples -----------------------------------------


def tiny_opt(seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=24,
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=16,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dropout=0.0,
    )
    torch.manual_seed(seed)
    return OPTForCausalLM(config).eval()


def force_eos_at(model, steps: list[int]) -> list[int]:
    """Row r samples EOS exactly at response step steps[r] (forward 0 is the prefill) and never before;
    returns the list that counts the model's forward calls."""
    calls: list[int] = []

    def hook(_module, _args, output):
        step = len(calls)
        calls.append(step)
        for row, k in enumerate(steps):
            if step < k:
                output.logits[row, -1, EOS] = -1e4
            elif step == k:
                output.logits[row, -1, :] = -1e4
                output.logits[row, -1, EOS] = 1e4
        return output

    model.register_forward_hook(hook)
    return calls


TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
PROMPTS = torch.tensor([[PAD, 5, 6], [4, 7, 8], [PAD, PAD, 9], [3, 3, 3]])
PROMPT_MASK = (PROMPTS != PAD).long()


def models_for(model, path: str, synced: bool = False):
    actor = SimpleNamespace(eval=lambda: None, module=model)
    if path == "he":
        from deepspeed.runtime.rollout import HybridEngineRollout

        rollout = HybridEngineRollout(engine=actor, tokenizer=TOKENIZER)
    else:
        rollout = rl_rollout.ModuleRollout(actor, TOKENIZER, synced_gpus=synced)
    return rl_rollout.PPOModels(actor, None, None, None, rollout, TOKENIZER, synced)


def old_generate(models, cfg):
    """rollout.generate as 892bdca had it: min_p 0, remove_invalid_values, no stopping criterion added."""
    from deepspeed.runtime.rollout import RolloutRequest

    settings = generation_config(Sampling.of(cfg), cfg.max_new_tokens, TOKENIZER)
    settings.remove_invalid_values = True
    with rl_rollout.only_settings(models.actor.module, settings):
        return models.rollout.generate(RolloutRequest(PROMPTS, PROMPT_MASK), rl_rollout.sampling_config(cfg))


def seeded(fn, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def masks(batch):
    return response_masks(batch.input_ids, PROMPT_MASK, batch.response_start_idx, EOS)


def assert_same_up_to_padding(new, old, width: int):
    assert new.input_ids.shape[1] == PROMPTS.shape[1] + width
    assert torch.equal(new.input_ids, old.input_ids[:, : new.input_ids.shape[1]])
    assert (old.input_ids[:, new.input_ids.shape[1] :] == PAD).all()  # the old rest is padding only
    for got, full in zip(masks(new), masks(old), strict=True):
        assert torch.equal(got, full[:, : got.shape[1]]) and not full[:, got.shape[1] :].any()


@pytest.mark.parametrize("path", ["he", "module"])
def test_rollout_stops_after_the_forward_where_the_last_row_ends(path):
    cfg = PPOConfig(max_new_tokens=10)
    ends = [2, 4, 1, 3]  # the last row to end samples EOS at step 4: 5 forwards (prefill + 4 decodes)
    model = tiny_opt()
    calls = force_eos_at(model, ends)
    new = seeded(lambda: rl_rollout.generate(models_for(model, path), PROMPTS, PROMPT_MASK, cfg), 7)
    assert len(calls) == max(ends) + 1
    calls.clear()
    old = seeded(lambda: old_generate(models_for(model, path), cfg), 7)
    assert len(calls) == (cfg.max_new_tokens if path == "he" else max(ends) + 1)  # plain generate stopped already
    assert_same_up_to_padding(new, old, max(ends) + 1)
    _, response = masks(new)
    assert response.sum(-1).tolist() == [k + 1 for k in ends]  # each response runs through its EOS
    assert "generate" not in vars(model)  # the hook is gone after the rollout


def test_a_rollout_where_a_row_never_ends_runs_every_step():
    cfg = PPOConfig(max_new_tokens=6)
    model = tiny_opt()
    calls = force_eos_at(model, [1, 2, 99, 0])
    new = seeded(lambda: rl_rollout.generate(models_for(model, "he"), PROMPTS, PROMPT_MASK, cfg), 3)
    assert len(calls) == cfg.max_new_tokens
    assert new.input_ids.shape[1] == PROMPTS.shape[1] + cfg.max_new_tokens


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.7, 5, 0.9), Sampling(1.3, 0, 0.8)])
@pytest.mark.parametrize("path", ["he", "module"])
def test_the_new_sampling_setup_draws_the_same_samples_under_a_fixed_seed(path, sampling):
    cfg = PPOConfig(max_new_tokens=12, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    for seed in range(3):
        model = tiny_opt(seed)
        new = seeded(lambda: rl_rollout.generate(models_for(model, path), PROMPTS, PROMPT_MASK, cfg), seed)  # noqa: B023
        old = seeded(lambda: old_generate(models_for(model, path), cfg), seed)  # noqa: B023
        assert_same_up_to_padding(new, old, new.input_ids.shape[1] - PROMPTS.shape[1])


def test_no_op_processors_are_skipped_and_invalid_scores_are_still_repaired():
    from transformers.generation.logits_process import InfNanRemoveLogitsProcessor

    model = tiny_opt()
    seen = {}
    real = model._get_logits_processor

    def spy(generation_config, *args, **kwargs):
        seen["processors"] = real(generation_config, *args, **kwargs)
        return seen["processors"]

    model._get_logits_processor = spy
    seeded(lambda: rl_rollout.generate(models_for(model, "he"), PROMPTS, PROMPT_MASK, PPOConfig(max_new_tokens=2)), 0)
    assert [type(p).__name__ for p in seen["processors"]] == ["RepairInvalid"]  # no MinP(0), no InfNan pass
    scores = torch.randn(3, 8)
    assert rl_rollout.RepairInvalid()(None, scores) is scores  # finite: untouched
    scores[0, 1], scores[1, 2], scores[2, 3] = float("nan"), float("inf"), float("-inf")
    assert torch.equal(rl_rollout.RepairInvalid()(None, scores), InfNanRemoveLogitsProcessor()(None, scores))


def test_generate_passes_synced_gpus_so_zero3_ranks_stop_at_the_same_step():
    seen = {}

    class Module:
        generation_config = None

        def generate(self, *args, **kwargs):
            seen.update(kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            return torch.cat([ids, torch.full((ids.shape[0], 1), EOS)], 1)

    for synced in (False, True):
        module = Module()
        models = models_for(module, "he", synced)
        with contextlib.suppress(Exception):
            rl_rollout.generate(models, PROMPTS, PROMPT_MASK, PPOConfig(max_new_tokens=1))
        assert seen["synced_gpus"] is synced
        assert isinstance(seen["stopping_criteria"][0], rl_rollout.EndedAtEOS)
        assert "generate" not in vars(module)


# --- log-prob passes: the LM head and the log-softmax only where some row has a response action -----------


def test_log_prob_passes_skip_the_prompt_and_keep_the_ratio_exactly_one():
    from kubealign.models.token_logprobs import first_target_column, keeps_logits
    from kubealign.rl.experience import paired_logprobs, policy_logprobs

    model = tiny_opt()
    cfg = PPOConfig(max_new_tokens=6)
    batch = seeded(lambda: rl_rollout.generate(models_for(model, "he"), PROMPTS, PROMPT_MASK, cfg), 0)
    attention, response = masks(batch)
    assert keeps_logits(model) and first_target_column(response) == PROMPTS.shape[1] - 1  # the fallback's cut
    assert first_target_column(torch.zeros(2, 4, dtype=torch.long)) == 0
    for sampling in (Sampling(), Sampling(0.7, 5, 0.9)):
        logprobs, ref = paired_logprobs(model, model, batch.input_ids, attention, response, sampling)
        full = scaled_logits(forward_logits(model, batch.input_ids, attention), sampling)
        by_hand = response_only(logprobs_from_logits(full, batch.input_ids), response)
        assert torch.allclose(logprobs, by_hand, atol=1e-6) and torch.equal(logprobs, ref)
        assert (logprobs[:, : PROMPTS.shape[1] - 1] == 0).all()
        # The update's pass is the experience's pass: the PPO ratio is exactly 1 before the first step.
        again, entropy = policy_logprobs(model, batch.input_ids, attention, response, sampling, entropy_grad=False)
        assert torch.equal(again, logprobs)
        assert torch.allclose(entropy, response_only(entropy_from_logits(full), response), atol=1e-6)


def test_gae_skips_the_prompt_columns_with_bit_identical_results():
    from kubealign.rl.advantages import gae

    def full_loop(values, rewards, mask, gamma, lam):  # 892bdca's loop: every column, prompt included
        mask = mask.to(values.dtype)
        values, rewards = values * mask, rewards * mask
        advantages = torch.zeros_like(values)
        next_value, next_advantage = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
        for t in reversed(range(values.shape[1])):
            current = (rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage) * mask[:, t]
            advantages[:, t] = current
            next_value = torch.where(mask[:, t] > 0, values[:, t], torch.zeros_like(next_value))
            next_advantage = torch.where(mask[:, t] > 0, current, torch.zeros_like(next_advantage))
        return advantages, (advantages + values) * mask

    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    mask = torch.zeros(5, 12, dtype=torch.long)
    for row, (start, end) in enumerate([(4, 12), (4, 6), (5, 9), (4, 5), (7, 12)]):
        mask[row, start:end] = 1
    got = gae(values, rewards, mask, 0.99, 0.95)
    want = full_loop(values, rewards, mask, 0.99, 0.95)
    assert torch.equal(got.advantages, want[0]) and torch.equal(got.returns, want[1])
    empty = gae(values, rewards, torch.zeros_like(mask), 0.99, 0.95)
    assert not empty.advantages.any() and not empty.returns.any()
