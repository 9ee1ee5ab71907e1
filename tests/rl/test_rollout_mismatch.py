"""The rollout-trainer mismatch (issue 57) on real tiny OPT models: the log-probs the rollout sampled with are
kept from generate's own loop on both rollout paths, equal the trainer's when both run one fp32 model, and
differ — measured, logged for every route and corrected — when the rollout is made to compute other logits."""

from __future__ import annotations

import pytest
import torch

from kubealign.config.schema import PPOConfig
from kubealign.errors import UserError
from kubealign.rewards.scorer import Scorer
from kubealign.rl import iteration, losses, targets
from kubealign.rl import rollout as rl_rollout
from kubealign.rl.correction import mismatch
from kubealign.rl.experience import make_experience
from kubealign.rl.kl import KLController
from kubealign.rl.losses import Sampling
from kubealign.rl.rollout import PPOModels, SampledLogprobs
from tests.rl.test_experience import TokenValue
from tests.rl.test_ppo_reuse import setup
from tests.rl.test_ppo_speed_paths import EOS, PROMPT_MASK, PROMPTS, TOKENIZER, models_for, tiny_opt

SAME_PATH = 1e-5  # fp32: the KV-cached decode and the full forward round differently, by ~1e-7 here


def biased(bias: float):
    """A forward hook adding `bias` to token 5's logit in eval mode only: the rollout's forwards (generate puts
    the actor in eval mode), not the trainer's (which return the target log-probs, models.token_logprobs,
    not logits, whatever the mode: here the frozen reference is the same module, in eval mode)."""

    def hook(module, _args, out):
        if not module.training and hasattr(out, "logits"):
            out.logits[..., 5] += bias

    return hook


def rollout_and_trainer(path: str, cfg: PPOConfig, bias: float = 0.0):
    """(rollout log-probs, trainer log-probs, response mask) of one rollout of tiny_opt(0); bias: added to token
    5's logit in eval mode only — the rollout's forwards, not the trainer's (a kernel that computes otherwise)."""
    model = tiny_opt(0)
    handle = model.register_forward_hook(biased(bias))
    recorder = SampledLogprobs(Sampling.of(cfg))
    torch.manual_seed(0)
    batch = rl_rollout.generate(models_for(model, path), PROMPTS, PROMPT_MASK, cfg, recorder)
    models = PPOModels(model, None, model, Scorer(TokenValue(), 1.0, None, None), None, None)
    exp = make_experience(batch, PROMPT_MASK, EOS, models, Sampling.of(cfg))
    handle.remove()
    rollout = recorder.actions(batch)
    assert rollout is not None and rollout.shape == exp.logprobs.shape
    return rollout, exp.logprobs, exp.response_mask


@pytest.mark.parametrize("path", ["he", "module"])
@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 30, "top_p": 1.0}], ids=["plain", "tempered"])
def test_the_rollouts_logprobs_are_the_trainers_on_one_fp32_path(path, settings):
    rollout, trainer, mask = rollout_and_trainer(path, PPOConfig(max_new_tokens=5, **settings))
    gap = mismatch(trainer, rollout, mask)
    assert gap.count >= 8  # response tokens were compared
    assert gap.abs_max < SAME_PATH


def test_a_truncating_sampler_is_measured_against_the_unfiltered_trainer():
    # top-k 3 renormalizes over 3 tokens: each sampled token's rollout probability exceeds the trainer's
    rollout, trainer, mask = rollout_and_trainer("module", PPOConfig(max_new_tokens=5, top_k=3))
    assert bool((rollout[mask.bool()] >= trainer[mask.bool()] - SAME_PATH).all())
    assert mismatch(trainer, rollout, mask).abs_sum > 0.5


def routed_models(cfg: PPOConfig, bias: float):
    models, gen = setup(cfg)
    models.rollout, models.tokenizer = rl_rollout.ModuleRollout(models.actor, TOKENIZER, False), TOKENIZER
    models.actor.module.register_forward_hook(biased(bias))
    return models, gen


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "rloo"])
def test_every_route_logs_the_mismatch_and_corrects_it(algorithm, monkeypatch):
    seen = []
    real = losses.policy_loss
    monkeypatch.setattr(losses, "policy_loss", lambda *a, **k: seen.append(k["weights"]) or real(*a, **k))
    base = {"algorithm": algorithm, "max_new_tokens": 5, "micro_batch_size": 16, "samples_per_prompt": 2}
    for bias, kind in ((0.0, "none"), (3.0, "tis")):
        cfg = PPOConfig(**base, rollout_correction={"kind": kind, "cap": 1.2})
        models, gen = routed_models(cfg, bias)
        torch.manual_seed(0)
        metrics, exp = iteration.iteration(models, PROMPTS, PROMPT_MASK, cfg, KLController(0.1), gen)
        assert exp.rollout_logprobs is not None
        if kind == "none":  # the same path: nothing to measure, nothing corrected
            assert metrics["rollout_logprob_diff_max"] < SAME_PATH and seen[-1] is None
            assert "rollout_corrected_fraction" not in metrics
            continue
        assert metrics["rollout_logprob_diff_mean"] > 0.05 and metrics["rollout_logprob_diff_max"] > 0.5
        w = (exp.logprobs - exp.rollout_logprobs).exp().clamp(max=1.2)
        resp = exp.response_mask.bool()
        assert seen[-1].shape[0] == exp.input_ids.shape[0]  # one minibatch of every row, shuffled:
        given = seen[-1][seen[-1] != 1.0]  # each token's loss weighted by its truncated weight (1: outside)
        assert torch.allclose(given.sort().values, w[resp & (w != 1.0)].sort().values)
        assert 0 < metrics["rollout_corrected_fraction"] < 1


def test_a_correction_without_the_rollouts_logprobs_is_refused():
    cfg = PPOConfig(rollout_correction={"kind": "mask"})
    exp = SimpleExperience()
    with pytest.raises(UserError, match="ppo.rollout_correction.kind=mask needs the rollout's log-probs"):
        targets.rollout_correction(exp, cfg)
    assert targets.rollout_correction(exp, PPOConfig()) == (None, {})


class SimpleExperience:
    rollout_logprobs = None


def test_the_max_mismatch_pools_every_rank(monkeypatch):
    from kubealign.training import distributed

    trainer = torch.tensor([[-1.0, -2.0]])
    exp = SimpleExperience()
    exp.logprobs, exp.rollout_logprobs, exp.response_mask = trainer, trainer - 0.5, torch.ones(1, 2)
    # the other rank: 6 tokens, |diff| summing to 9, one of 4
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda v: [v[0] + 9.0, v[1] + 6.0, v[2] + 0.0])
    monkeypatch.setattr(distributed, "all_reduce_max", lambda v: [max(v[0], 4.0)])
    _, metrics = targets.rollout_correction(exp, PPOConfig())
    assert metrics == pytest.approx({"rollout_logprob_diff_mean": 10 / 8, "rollout_logprob_diff_max": 4.0})
