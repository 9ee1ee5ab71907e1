"""ppo.reuse_first_forward (issue 15): the update's first step takes the actor's (and with `both` the
critic's) forward of the experience pass instead of running them again. Run on real tiny OPT actor /
critic / reference / reward models, with and without, from the same weights and minibatch generator: the
same experience, losses and updated weights, the first minibatch's rows run once less by each reused model
— in every configuration the reuse touches (one minibatch or several, two epochs, truncated sampling, an
entropy bonus, no critic)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kubealign.config.schema import PPOConfig
from kubealign.rewards.scorer import Scorer
from kubealign.rl import iteration
from kubealign.rl import rollout as rl_rollout
from kubealign.rl.experience import make_experience, make_experience_keeping, policy_logprobs
from kubealign.rl.kl import KLController
from kubealign.rl.losses import Sampling
from tests.rl.test_ppo_speed_paths import BOS, EOS, PAD, tiny_opt


class SGDEngine(torch.nn.Module):
    """The engine calls the trainer makes (forward, backward, step) over a plain module, plain SGD; counts
    the rows it ran forwards on."""

    def __init__(self, module: torch.nn.Module, lr: float = 0.5):
        super().__init__()
        self.module, self.lr, self.rows = module, lr, 0

    def forward(self, *args, **kwargs):
        self.rows += kwargs["input_ids"].shape[0]
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
                    p.grad = None


def tiny_critic(seed: int):
    from transformers import OPTConfig, OPTForSequenceClassification

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
        num_labels=1,
    )
    torch.manual_seed(seed)
    return OPTForSequenceClassification(config)


# Six rollouts, prompts left-padded to 4 (rows 1 and 4 shorter), responses of 6 with EOS at different
# steps (row 2 at the first step, row 5 never): padding differs in every row.
IDS = torch.tensor(
    [
        [BOS, 5, 6, 7, 8, 9, 10, 11, 12, 13],
        [PAD, PAD, BOS, 7, 3, 4, EOS, PAD, PAD, PAD],
        [BOS, 9, 9, 4, EOS, PAD, PAD, PAD, PAD, PAD],
        [BOS, 11, 12, 13, 14, 15, 16, EOS, PAD, PAD],
        [PAD, BOS, 20, 21, 22, 6, 5, 4, EOS, PAD],
        [BOS, 3, 4, 5, 17, 18, 19, 20, 21, 22],
    ]
)
PROMPT_MASK = (IDS[:, :4] != PAD).long()


def setup(cfg: PPOConfig):
    """Fresh engines with fixed weights, a fixed rollout (generate replaced), and the minibatch generator."""
    actor, critic = SGDEngine(tiny_opt(0).train()), SGDEngine(tiny_critic(1).train())
    reference, reward = tiny_opt(2).eval(), tiny_critic(3).eval()
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    scorer = Scorer(reward, 1.0, None, None)
    models = rl_rollout.PPOModels(actor, critic if cfg.algorithm == "ppo" else None, reference, scorer, None, tokenizer)
    return models, torch.Generator().manual_seed(7)


def sampled(cfg: PPOConfig) -> torch.Tensor:
    """IDS' prompts with responses the actor samples under cfg's settings (inside its top-k / nucleus)."""
    torch.manual_seed(3)
    with torch.no_grad():
        return tiny_opt(0).generate(
            input_ids=IDS[:, :4],
            attention_mask=PROMPT_MASK,
            do_sample=True,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            temperature=cfg.temperature,
            max_new_tokens=6,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )


def run(cfg: PPOConfig, monkeypatch):
    models, gen = setup(cfg)
    ids = sampled(cfg) if cfg.top_k or cfg.top_p < 1 else IDS.clone()
    batch = SimpleNamespace(input_ids=ids, response_start_idx=torch.full((6,), 4))
    monkeypatch.setattr(rl_rollout, "generate", lambda *args: batch)
    metrics, exp = iteration.iteration(models, IDS[:, :4], PROMPT_MASK, cfg, KLController(0.1), gen)
    return models, metrics, exp


CONFIGS = {
    "one-minibatch": {"micro_batch_size": 6},
    "one-minibatch-truncated": {"micro_batch_size": 6, "top_k": 5},  # every row kept: no rest to stack
    "three-minibatches-two-epochs-truncated-entropy": {
        "micro_batch_size": 2,
        "ppo_epochs": 2,
        "top_k": 6,
        "top_p": 0.9,
        "temperature": 0.7,
        "entropy_coef": 0.05,
    },
    "grpo-two-minibatches": {"algorithm": "grpo", "samples_per_prompt": 3, "micro_batch_size": 3},
}


@pytest.mark.parametrize("reuse", ["actor", "both"])
@pytest.mark.parametrize("settings", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_reused_first_forward_gives_the_same_update_with_one_forward_less(settings, reuse, monkeypatch):
    runs = {}
    for setting in ("none", reuse):
        cfg = PPOConfig(max_new_tokens=6, reuse_first_forward=setting, **settings)  # grpo: 2 prompts x 3 samples
        runs[setting] = run(cfg, monkeypatch)
    (plain, m_plain, e_plain), (reused, m_reused, e_reused) = runs["none"], runs[reuse]
    for field in ("logprobs", "ref_logprobs", "values", "scores"):
        a, b = getattr(e_plain, field), getattr(e_reused, field)
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6)), field
    for key in ("policy_loss", "clip_fraction", "approx_kl", "entropy", "value_loss", "kl_loss", "reward_mean", "kl"):
        if key in m_plain:
            assert m_reused[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    start = tiny_opt(0).state_dict()
    moved = 0.0
    for name, value in reused.actor.module.state_dict().items():
        assert torch.allclose(value, plain.actor.module.state_dict()[name], atol=1e-6), name
        moved = max(moved, float((value - start[name]).abs().max()))
    assert moved > 1e-3  # the actor did step
    if reused.critic is not None:
        for name, value in reused.critic.module.state_dict().items():
            assert torch.allclose(value, plain.critic.module.state_dict()[name], atol=1e-6), name
    # The first minibatch's rows are run once less by each reused model (its own forward).
    micro = settings["micro_batch_size"]
    assert reused.actor.rows == plain.actor.rows - micro
    if reused.critic is not None:
        assert reused.critic.rows == plain.critic.rows - (micro if reuse == "both" else 0)
    # The ratio on the first minibatch is measured by a second forward only: without one it is not logged.
    assert m_plain["approx_kl_first"] == 0 and m_plain["clip_fraction_first"] == 0
    assert "approx_kl_first" not in m_reused and "clip_fraction_first" not in m_reused


def test_the_kept_forward_is_the_updates_own_call_on_the_minibatchs_rows_in_its_order():
    cfg = PPOConfig(micro_batch_size=3, top_k=5, temperature=0.8)
    models, _ = setup(cfg)
    batch = SimpleNamespace(input_ids=IDS, response_start_idx=torch.full((6,), 4))
    rows = torch.tensor([4, 1, 5])
    sampling = Sampling(0.8, 5, 1.0)
    exp, first = make_experience_keeping(batch, PROMPT_MASK, EOS, models, sampling, rows, False, keep_critic=True)
    whole = make_experience(batch, PROMPT_MASK, EOS, models, sampling)
    assert torch.equal(first.rows, rows) and first.logprobs.requires_grad and first.values.requires_grad
    assert not first.entropy.requires_grad  # entropy_coef 0: logged only
    # exactly what actor_objective would compute for this minibatch
    ids, mask, resp = exp.input_ids[rows], exp.attention_mask[rows], exp.response_mask[rows]
    again, entropy = policy_logprobs(models.actor, ids, mask, resp, sampling, entropy_grad=False)
    assert torch.equal(first.logprobs, again) and torch.equal(first.entropy, entropy)
    assert torch.equal(exp.logprobs[rows], first.logprobs.detach())
    for field in ("logprobs", "ref_logprobs", "values", "scores", "attention_mask", "response_mask"):
        assert torch.allclose(getattr(exp, field).float(), getattr(whole, field).float(), atol=1e-6), field
    assert exp.logprobs[2].abs().sum() > 0 and exp.ref_logprobs[0].abs().sum() > 0  # rows outside `rows` filled


@pytest.mark.parametrize("truncate", [False, True], ids=["plain", "top-k"])
def test_the_frozen_models_run_before_the_actors_graph_is_held_top_k_or_not(truncate):
    cfg = PPOConfig(micro_batch_size=4, top_k=5 if truncate else 0)
    models, _ = setup(cfg)
    order: list[str] = []
    for name in ("actor", "reference", "critic", "reward"):
        module = getattr(models, name)
        module = module.model if name == "reward" else module  # the Scorer's reward model
        module.register_forward_pre_hook(lambda _m, _a, _k, name=name: order.append(name), with_kwargs=True)
    batch = SimpleNamespace(input_ids=sampled(cfg) if truncate else IDS, response_start_idx=torch.full((6,), 4))
    exp, first = make_experience_keeping(
        batch, PROMPT_MASK, EOS, models, Sampling.of(cfg), torch.tensor([5, 0, 3, 2]), False
    )
    # The reference's log-probs are unfiltered (losses.scaled_logits): it needs nothing of the actor.
    assert order == ["reward", "reference", "actor", "actor", "critic"]
    assert first.values is None and not exp.values.requires_grad  # the critic is not kept by default
    whole = make_experience(batch, PROMPT_MASK, EOS, models, Sampling.of(cfg))
    assert torch.equal(exp.values, whole.values) and torch.equal(exp.ref_logprobs, whole.ref_logprobs)
