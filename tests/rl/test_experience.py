"""Experience: masks, temperature-scaled unfiltered log-probs, mode switches and the KL controller's input, on
hand-made models whose outputs can be worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kubealign.rewards.scorer import Scorer
from kubealign.rl.advantages import kl_penalized_rewards, last_action_index
from kubealign.rl.experience import make_experience, paired_logprobs, policy_logprobs, response_masks
from kubealign.rl.losses import (
    PolicyLossSettings,
    Sampling,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    scaled_logits,
)
from kubealign.rl.rollout import PPOModels

EOS = 2  # also the pad token, as build_models makes it for a tokenizer without one
LOG = math.log


class TableLM(torch.nn.Module):
    """Next-token logits that depend on the current token only: logits[b, t] = table[input_ids[b, t]].
    Records whether it was in train mode at each forward."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())
        self.modes: list[bool] = []
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.modes.append(self.training)
        self.calls.append({"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": use_cache})
        return SimpleNamespace(logits=self.table[input_ids])


class Score(torch.nn.Module):
    def forward(self, x):
        return x


class TokenValue(torch.nn.Module):
    """A 'reward model' whose value at each position is 10 * token id + position (head named score)."""

    def __init__(self):
        super().__init__()
        self.score = Score()
        self.modes: list[bool] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.modes.append(self.training)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.score((10.0 * input_ids + positions).unsqueeze(-1))


def close(x: torch.Tensor, rows: list[list[float]]) -> bool:
    return torch.allclose(x.double(), torch.tensor(rows, dtype=torch.float64), atol=1e-6)


def probs_table(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


# Vocabulary of 4; token 3's next-token distribution is [0.1, 0.2, 0.3, 0.4], every other token's is
# [0.4, 0.3, 0.2, 0.1].
TABLE = probs_table([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])


def test_response_masks_by_hand_with_padding_and_an_eos_in_the_prompt():
    # Prompt width 3 (left-padded with EOS = pad), responses from column 3 on.
    ids = torch.tensor(
        [
            [2, 3, 1, 3, 2, 1, 1],  # 1 pad; response 3, EOS; then 1 1 after the EOS are padding
            [3, 2, 1, 1, 1, 1, 1],  # an EOS inside the prompt does not end anything; no EOS in the response
            [2, 2, 3, 2, 3, 3, 3],  # 2 pads; the response is a lone EOS
        ]
    )
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    attention, response = response_masks(ids, prompt_mask, torch.tensor([3, 3, 3]), EOS)
    assert attention.tolist() == [
        [0, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0, 0],
    ]
    # Action t produced token t + 1: response actions are columns 2.. of the token positions minus one.
    assert response.tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 0, 0, 0],
    ]


def test_last_action_index_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert last_action_index(mask).tolist() == [3, 5, 2, 0]


def test_kl_penalized_rewards_put_each_score_at_its_rows_last_action():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    zeros = torch.zeros(3, 4, dtype=torch.float64)
    out = kl_penalized_rewards(zeros, zeros, torch.tensor([1.0, -7.0, 2.0]), mask, kl_coef=0.5, reward_clip=5)
    assert out.rewards.tolist() == [[0, 0, 1, 0], [0, 0, 0, -5], [2, 0, 0, 0]]


def test_kl_and_policy_loss_ignore_minus_infinity_outside_the_response():
    # A model may give a prompt token log-prob -inf (a logit at -inf): outside the response it is never read.
    inf = float("-inf")
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    lp, old = torch.tensor([[inf, -1.0, -2.0]]), torch.tensor([[inf, -1.0, -2.0]])
    rewards = kl_penalized_rewards(lp, torch.tensor([[inf, -1.5, -2.0]]), torch.tensor([0.0]), mask, 1.0, 5.0)
    assert rewards.kl.tolist() == [[0.0, 0.5, 0.0]]
    out = policy_loss(lp, old, torch.tensor([[3.0, 1.0, -1.0]]), mask, PolicyLossSettings(cliprange=0.2))
    assert out.loss.item() == 0.0 and out.approx_kl.item() == 0.0 and out.clip_fraction.item() == 0.0


def test_scaled_logits_take_the_temperature_and_ignore_top_k_and_top_p():
    logits = torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]).log()
    ids = torch.tensor([[0, 3]])  # token 3: outside top-k 1 and outside the 0.7 nucleus
    for sampling in (Sampling(), Sampling(top_p=0.7), Sampling(top_k=1), Sampling(top_k=3, top_p=0.7)):
        got = logprobs_from_logits(torch.cat([scaled_logits(logits, sampling)] * 2, 1), ids)
        assert got.item() == pytest.approx(LOG(0.05)), sampling  # the filter shapes sampling only: finite
    # Temperature 0.5 squares the probabilities before normalizing, top-k or not.
    squares = [p * p for p in (0.5, 0.3, 0.15, 0.05)]
    for sampling in (Sampling(temperature=0.5), Sampling(temperature=0.5, top_k=1, top_p=0.5)):
        hot = logprobs_from_logits(torch.cat([scaled_logits(logits, sampling)] * 2, 1), ids)
        assert hot.item() == pytest.approx(LOG(squares[3] / sum(squares)))
    assert scaled_logits(logits.half(), Sampling()).dtype == torch.float32
    roots = [p**0.5 for p in (0.5, 0.3, 0.15, 0.05)]  # temperature 2: square roots
    cool = logprobs_from_logits(torch.cat([scaled_logits(logits, Sampling(temperature=2.0))] * 2, 1), ids)
    assert cool.item() == pytest.approx(LOG(roots[3] / sum(roots)))


def test_entropy_with_a_minus_infinity_logit_has_no_nan_value_or_gradient():
    inf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, inf, inf], [0.0, 0.0, 0.0, 0.0], [0.0] * 4]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy[0, 0].item() == pytest.approx(LOG(2)) and entropy[0, 1].item() == pytest.approx(LOG(4))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def experience_batch():
    # Prompt width 2; row 0: prompt [pad, 3], response 3 EOS; row 1: prompt [1, 3], response 0 0 (no EOS).
    ids = torch.tensor([[2, 3, 3, 2], [1, 3, 0, 0]])
    return SimpleNamespace(input_ids=ids, response_start_idx=torch.tensor([2, 2])), torch.tensor([[0, 1], [1, 1]])


def test_make_experience_by_hand_and_modes():
    batch, prompt_mask = experience_batch()
    actor, reference = TableLM(TABLE), TableLM(probs_table([[0.25] * 4] * 4))
    critic, reward = TokenValue(), TokenValue()
    for model in (actor, reference, critic, reward):
        model.train() if model in (reference, reward) else model.eval()  # the opposite of what is needed
    exp = make_experience(
        batch,
        prompt_mask,
        EOS,
        PPOModels(actor, critic, reference, Scorer(reward, 1.0, None, None), None, None),
        Sampling(),
    )
    assert exp.attention_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert exp.response_mask.tolist() == [[0, 1, 1], [0, 1, 1]]
    # row 0: 3 -> 3 (0.4), 3 -> EOS (0.3); row 1: 3 -> 0 (0.1), 0 -> 0 (0.4); the reference is uniform.
    assert close(exp.logprobs, [[0, LOG(0.4), LOG(0.3)], [0, LOG(0.1), LOG(0.4)]])
    assert close(exp.ref_logprobs, [[0, LOG(0.25), LOG(0.25)], [0, LOG(0.25), LOG(0.25)]])
    # values: 10 * token + position at positions 0..2; scores at the last real token (3 and 3).
    assert exp.values.tolist() == [[20, 31, 32], [10, 31, 2]]
    assert exp.scores.tolist() == [23, 3]
    # The actor and the critic run in train mode (hybrid engine: training layers, dropout off), the
    # frozen reference and reward model in eval mode.
    assert actor.modes == [True] and critic.modes == [True]
    # Every pass sees the masks (position ids that skip the left padding) and builds no KV cache.
    call = actor.calls[0]
    assert torch.equal(call["attention_mask"], exp.attention_mask) and call["use_cache"] is False
    assert call["position_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    assert reference.modes == [False] and reward.modes == [False]


def test_make_experience_log_probs_are_tempered_and_unfiltered():
    batch, prompt_mask = experience_batch()
    actor, reference = TableLM(TABLE), TableLM(probs_table([[0.25] * 4] * 4))
    sampling = Sampling(temperature=0.5, top_k=3, top_p=0.5)
    exp = make_experience(
        batch,
        prompt_mask,
        EOS,
        PPOModels(actor, TokenValue(), reference, Scorer(TokenValue(), 1.0, None, None), None, None),
        sampling,
    )
    # Temperature 0.5 squares token 3's [0.1, 0.2, 0.3, 0.4] (sum 0.30) and the others' [0.4, 0.3, 0.2, 0.1].
    # Row 0: 3 -> 3 (0.16), 3 -> EOS (0.09). Row 1: 3 -> 0 (0.01): outside top-k 3 and the 0.5 nucleus,
    # drawn here only because this batch is made up — still finite, as a bf16 edge token must be; 0 -> 0.
    assert close(exp.logprobs, [[0, LOG(0.16 / 0.3), LOG(0.09 / 0.3)], [0, LOG(0.01 / 0.3), LOG(0.16 / 0.3)]])
    assert close(exp.ref_logprobs, [[0, LOG(0.25), LOG(0.25)], [0, LOG(0.25), LOG(0.25)]])  # uniform stays so


def test_policy_logprobs_and_paired_logprobs_are_zero_outside_the_response():
    batch, prompt_mask = experience_batch()
    attention, response = response_masks(batch.input_ids, prompt_mask, batch.response_start_idx, EOS)
    model = TableLM(TABLE)
    logprobs, entropy = policy_logprobs(model, batch.input_ids, attention, response, Sampling(top_k=1), True)
    assert logprobs[:, 0].tolist() == [0, 0] and entropy[:, 0].tolist() == [0, 0]
    # Unfiltered entropies: every distribution in TABLE is a permutation of [0.1, 0.2, 0.3, 0.4].
    h = -sum(p * LOG(p) for p in (0.1, 0.2, 0.3, 0.4))
    assert close(entropy, [[0, h, h], [0, h, h]])
    for sampling in (Sampling(top_p=0.5), Sampling(top_k=1), Sampling(temperature=0.5, top_k=2, top_p=0.9)):
        mine, other = paired_logprobs(model, model, batch.input_ids, attention, response, sampling)
        assert torch.equal(mine, other), sampling  # one model against itself: KL exactly 0
        assert torch.isfinite(mine).all(), sampling


def test_module_rollout_passes_top_k_zero_not_the_models_default():
    from kubealign.config.schema import PPOConfig
    from kubealign.rl.rollout import ModuleRollout, sampling_config

    seen = {}

    class Module:
        def generate(self, **kwargs):
            seen.update(kwargs)
            return torch.cat([kwargs["input_ids"], torch.full((kwargs["input_ids"].shape[0], 2), EOS)], 1)

    rollout = ModuleRollout(
        SimpleNamespace(module=Module()), SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS), False
    )
    request = SimpleNamespace(prompt_ids=torch.tensor([[1, 3]]), prompt_attention_mask=torch.tensor([[1, 1]]))
    batch = rollout.generate(request, sampling_config(PPOConfig()))
    assert seen["top_k"] == 0  # None would mean "the model's generation_config", i.e. top-k 50
    assert batch.response_start_idx.tolist() == [2]


def test_generate_samples_in_eval_mode_with_exactly_the_configured_settings():
    from transformers import GenerationConfig

    from kubealign.config.schema import PPOConfig
    from kubealign.rl import rollout as rl_rollout

    modes = []
    own = GenerationConfig(repetition_penalty=1.3, top_k=50, min_p=0.1)  # what a checkpoint may bring
    module = SimpleNamespace(generation_config=own, generate=None)  # the rollout calls module.generate

    class Engine(TableLM):
        def eval(self):
            modes.append("eval")
            return super().eval()

    actor = Engine(TABLE)
    actor.module = module

    class Rollout:
        def generate(self, request, sampling):
            used = module.generation_config
            modes.append("generate:" + ("train" if actor.training else "eval"))
            modes.append((used.top_k, used.top_p, used.temperature, used.repetition_penalty, used.min_p))
            return "batch"

    tokenizer = SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS, bos_token_id=0)
    models = rl_rollout.PPOModels(actor, None, None, None, Rollout(), tokenizer)
    cfg = PPOConfig(top_k=7, top_p=0.9, temperature=0.8)
    assert rl_rollout.generate(models, torch.tensor([[1, 3]]), torch.tensor([[1, 1]]), cfg) == "batch"
    assert modes == ["eval", "generate:eval", (7, 0.9, 0.8, 1.0, None)]  # min_p None: no MinP(0) pass
    assert module.generation_config is own  # the checkpoint's own settings are back for the export


def test_the_kl_controller_sees_every_ranks_kl(monkeypatch):
    from kubealign.rl import targets
    from kubealign.rl.kl import KLController

    # This rank measured KL 1 and 3 (mean 2); the other rank measured 10 and 10 (sum 20, 2 samples).
    monkeypatch.setattr(targets.distributed, "all_reduce_sum", lambda v: [v[0] + 20.0, v[1] + 200.0, v[2] + 2.0])
    kl = KLController(0.1, target=4.0, horizon=100)
    assert targets.update_kl(kl, torch.tensor([1.0, 3.0])) == 6.0
    # mean over ranks = 24 / 4 = 6: error min(6 / 4 - 1, 0.2) = 0.2 over 4 samples (one rank alone: 2 / 4 - 1)
    assert kl.value == pytest.approx(0.1 * (1 + 0.2 * 4 / 100))


def test_logged_reward_and_kl_pool_every_ranks_values(monkeypatch):
    from kubealign.rl import targets

    # this rank scored 1 and 3; the other rank scored 5 and 7 (sum 12, squares 74, 2 samples)
    monkeypatch.setattr(targets.distributed, "all_reduce_sum", lambda v: [v[0] + 12.0, v[1] + 74.0, v[2] + 2.0])
    mean, std, count = targets.global_stats(torch.tensor([1.0, 3.0]))
    assert (mean, count) == (4.0, 4)
    assert std == pytest.approx(torch.tensor([1.0, 3.0, 5.0, 7.0]).std().item())  # unbiased, like torch.std
    monkeypatch.setattr(targets.distributed, "all_reduce_sum", lambda v: v)  # one rank
    assert targets.global_stats(torch.tensor([2.0])) == (2.0, 0.0, 1)


def test_ptx_batches_differ_across_ranks_and_wrap_around():
    from kubealign.rl.unsupervised import UnsupervisedData

    examples = [{"input_ids": [i]} for i in range(5)]
    ranks = [UnsupervisedData(examples, 2, 0, rank=r, world=2) for r in range(2)]
    served = [[e["input_ids"][0] for e in data.next_chunk()] for _ in range(2) for data in ranks]
    # round 0: rank 0 [0, 1], rank 1 [2, 3]; round 1: rank 0 [4, 0], rank 1 [1, 2]
    assert served == [[0, 1], [2, 3], [4, 0], [1, 2]]
    big = UnsupervisedData(examples, 7, 0)  # a batch larger than the data still has batch_size rows
    assert [e["input_ids"][0] for e in big.next_chunk()] == [0, 1, 2, 3, 4, 0, 1]
    resumed = UnsupervisedData(examples, 2, 0, served=1, rank=1, world=2)
    assert [e["input_ids"][0] for e in resumed.next_chunk()] == [1, 2]  # the position is all the state


def test_generation_config_turns_every_other_processor_off():
    from kubealign.rl.rollout import generation_config

    tokenizer = SimpleNamespace(pad_token_id=EOS, eos_token_id=3, bos_token_id=0)
    cfg = generation_config(Sampling(0.8, 7, 0.9), 12, tokenizer)
    fields = [
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "min_new_tokens",
        "max_new_tokens",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
    ]
    assert [getattr(cfg, f) for f in fields] == [True, 0.8, 7, 0.9, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0, 0, 12, EOS, 3, 0]


def test_a_non_finite_experience_names_what_is_not_finite_and_where():
    from kubealign.rl.experience import Experience
    from kubealign.rl.experience_checks import experience_fault

    inf, nan = float("inf"), float("nan")
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    finite = torch.tensor([[-inf, -1.0, -2.0], [nan, -1.0, nan]])  # non-finite outside the response only
    ok = Experience(torch.zeros(2, 4), torch.ones(2, 4), mask, finite, finite, None, torch.tensor([1.0, 2.0]))
    assert experience_fault(ok) == ("", False)
    bad = ok._replace(logprobs=torch.tensor([[0.0, -inf, -2.0], [0.0, -1.0, 0.0]]), scores=torch.tensor([1.0, nan]))
    assert experience_fault(bad) == (
        "the reward score is not finite (nan) for 1 of 2 responses; "
        "the actor's log-prob is not finite (-inf) for 1 of 3 tokens",
        True,  # the actor trains: the learning rate is a suspect
    )
    assert experience_fault(ok._replace(scores=torch.tensor([1.0, nan]))).trained is False  # frozen only
    values = torch.tensor([[0.0, 1.0, inf], [0.0, inf, 5.0]])
    bad = ok._replace(values=values, ref_logprobs=torch.tensor([[0.0, -1.0, -inf], [0.0, -1.0, 0.0]]))
    assert experience_fault(bad) == (
        "the reference's log-prob is not finite (-inf) for 1 of 3 tokens; "
        "the critic's value is not finite (inf) for 2 of 3 tokens",
        True,
    )
    assert experience_fault(ok._replace(ref_logprobs=bad.ref_logprobs)).trained is False
