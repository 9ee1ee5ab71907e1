"""The GRPO / RLOO edges where the docs and the peers (DAPO, veRL, TRL) say what must happen: dropped groups in
no denominator and no entropy mean, `token` as the global token mean over every rank, a step with nothing to
count skipped on every rank, unscored responses (every reward function None) out of the group statistics,
and a scorer that refuses rows that do not match its completions. Every value is computed by hand here from
the inputs, not read back from the code under test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kubealign.config.schema import PPOConfig, RewardsConfig
from kubealign.data import phases
from kubealign.rewards.scorer import Scorer, scored_rows
from kubealign.rl import iteration
from kubealign.rl import rollout as rl_rollout
from kubealign.rl.advantages import GRPO_EPS, group_std, grpo_advantages, rloo_advantages
from kubealign.rl.losses import PolicyLossSettings, aggregate, loss_denominator
from kubealign.rl.targets import global_stats, group_targets
from kubealign.training import distributed, loop
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner
from tests.rewards.test_rewards import FUNCTIONS, ORIGINS, CharTokenizer
from tests.stages.test_grpo import REWARDS, TableActor, hand_experience

GROUP0 = [-2 / (math.sqrt(7) + GRPO_EPS), -1 / (math.sqrt(7) + GRPO_EPS), 3 / (math.sqrt(7) + GRPO_EPS)]


def lengths(exp) -> list[int]:
    return [int(n) for n in exp.response_mask.sum(-1)]


def k3_sum(exp, row: int) -> float:
    """Sum over row's response actions of k3 = exp(ref - logp) - (ref - logp) - 1, from the tensors' entries."""
    total = 0.0
    for t in range(exp.response_mask.shape[1]):
        if exp.response_mask[row, t]:
            d = float(exp.ref_logprobs[row, t] - exp.logprobs[row, t])
            total += math.exp(d) - d - 1
    return total


# --- dropped groups ----------------------------------------------------------------------------------------


def test_constant_aggregation_divides_by_the_kept_rows_only():
    """Dr. GRPO's constant: sum over the kept rows' tokens / (kept rows * max_new_tokens). At the first step the
    ratio is 1, so each token's loss is -A of its row; group 1 (rewards 3 3 3) is dropped."""
    actor, exp = hand_experience(REWARDS)
    cfg = PPOConfig(
        algorithm="grpo",
        samples_per_prompt=3,
        reward_clip=10,
        drop_equal_reward_groups=True,
        loss_aggregation="constant",
        max_new_tokens=4,
    )
    targets = group_targets(exp, cfg, beta=0.1)
    n = lengths(exp)
    policy = sum(-GROUP0[i] * n[i] for i in range(3)) / (3 * 4)
    kl = sum(k3_sum(exp, i) for i in range(3)) / (3 * 4)
    inputs = iteration.UpdateInputs(exp, targets.advantages, keep=targets.keep, kl_coef=0.1)
    obj = iteration.actor_objective(actor, inputs, torch.arange(6), cfg, PolicyLossSettings.of(cfg))
    assert obj.policy.loss.item() == pytest.approx(policy, abs=1e-6)  # today's code: half of it (6 rows)
    assert obj.kl.item() == pytest.approx(kl, rel=1e-6)  # float32 log-probs
    assert obj.loss.item() == pytest.approx(policy + 0.1 * kl, abs=1e-6)


def test_the_entropy_bonus_averages_over_the_kept_rows_only():
    actor, exp = hand_experience(REWARDS)
    cfg = PPOConfig(
        algorithm="grpo", samples_per_prompt=3, reward_clip=10, drop_equal_reward_groups=True, entropy_coef=0.01
    )
    targets = group_targets(exp, cfg, beta=0.1)
    # the entropy of the actor's next-token distribution at each kept response action, by hand from its table
    probs = torch.softmax(actor.table.float(), -1)
    per_token = (-(probs * probs.log()).sum(-1)).tolist()  # the entropy after each token id
    kept = [per_token[int(exp.input_ids[i, t])] for i in range(3) for t in range(6) if exp.response_mask[i, t]]
    inputs = iteration.UpdateInputs(exp, targets.advantages, keep=targets.keep, kl_coef=0.1)
    obj = iteration.actor_objective(actor, inputs, torch.arange(6), cfg, PolicyLossSettings.of(cfg))
    assert obj.entropy.item() == pytest.approx(sum(kept) / len(kept), rel=1e-5)
    assert obj.loss.item() == pytest.approx((obj.policy.loss + 0.1 * obj.kl - 0.01 * obj.entropy).item(), rel=1e-6)


# --- the global token mean -----------------------------------------------------------------------------------


def fake_ranks(monkeypatch, other: list[float], world: int = 2) -> list[list[float]]:
    """This process as rank 0 of `world`, the others contributing `other` to every all_reduce_sum; returns the
    calls' arguments."""
    calls: list[list[float]] = []

    def reduce(values):
        calls.append(list(values))
        return [v + o for v, o in zip(values, other, strict=True)]

    monkeypatch.setattr(distributed, "all_reduce_sum", reduce)
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    return calls


def test_token_is_the_global_token_mean_over_every_rank(monkeypatch):
    """Rank 0 holds prompt 0's rows, rank 1 prompt 1's. Each rank divides its token sum by the global count /
    2; DeepSpeed then averages the two ranks: the mean of every token of both, not the mean of the two ranks'
    own token means (TRL's bnpo), which differ here because the ranks hold different numbers of tokens."""
    actor, exp = hand_experience(REWARDS)
    cfg = PPOConfig(algorithm="grpo", samples_per_prompt=3, reward_clip=10)
    row_adv = [1.0, -2.0, 0.5, 3.0, -1.0, 2.0]
    adv = torch.tensor(row_adv, dtype=torch.float64)[:, None] * exp.response_mask
    n = lengths(exp)
    assert sum(n[:3]) != sum(n[3:])  # the two ranks hold different token counts
    sums = [sum(-row_adv[i] * n[i] for i in rows) for rows in (range(3), range(3, 6))]
    global_mean = (sums[0] + sums[1]) / sum(n)
    per_rank_means = (sums[0] / sum(n[:3]) + sums[1] / sum(n[3:])) / 2
    assert abs(global_mean - per_rank_means) > 1e-3

    losses = []
    settings, inputs = PolicyLossSettings.of(cfg), iteration.UpdateInputs(exp, adv)
    for mine, theirs in ((range(3), range(3, 6)), (range(3, 6), range(3))):
        fake_ranks(monkeypatch, [float(sum(n[i] for i in theirs))])
        idx = torch.tensor(list(mine))
        denominator = iteration.minibatch_denominator(exp.response_mask[idx], settings)
        assert denominator == sum(n) / 2
        objective = iteration.actor_objective(actor, inputs, idx, cfg, settings, denominator=denominator)
        losses.append(objective.policy.loss.item())
    assert sum(losses) / 2 == pytest.approx(global_mean, abs=1e-6)  # what DeepSpeed's gradient average sees
    monkeypatch.undo()
    # one process holding every row: the same number
    one = iteration.actor_objective(actor, inputs, torch.arange(6), cfg, settings, denominator=None).policy.loss.item()
    assert one == pytest.approx(global_mean, abs=1e-6)


def test_loss_denominators_by_hand():
    # row 0: 3 response tokens, row 1: 1, row 2: none (an empty response still counts as a row for constant)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert loss_denominator(mask, "token") == 4
    assert loss_denominator(mask, "sequence") == 2
    assert loss_denominator(mask, "constant", max_tokens=4) == 12
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    assert aggregate(per_token, mask, "token", denominator=2.5).item() == pytest.approx(10 / 2.5)
    assert aggregate(per_token, mask, "sequence", denominator=0.5).item() == pytest.approx((2 + 4) / 0.5)
    assert aggregate(per_token, mask, "constant", 4, denominator=3.0).item() == pytest.approx(10 / 3)
    assert aggregate(per_token, torch.zeros_like(mask), "token", denominator=0.0).item() == 0.0  # not 0 / 0


# --- a step with nothing to count ---------------------------------------------------------------------------


class CountingActor(TableActor):
    def __init__(self, table):
        super().__init__(table)
        self.backwards, self.steps = 0, 0

    def backward(self, loss):
        self.backwards += 1
        super().backward(loss)

    def step(self):
        self.steps += 1
        super().step()


def test_a_step_where_every_rank_dropped_every_row_is_skipped(monkeypatch):
    _, exp = hand_experience(REWARDS)
    actor = CountingActor(torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    before = actor.table.detach().clone()
    cfg = PPOConfig(
        algorithm="grpo",
        samples_per_prompt=3,
        reward_clip=10,
        drop_equal_reward_groups=True,
        micro_batch_size=3,
        ppo_epochs=1,
    )
    # minibatch 0 = prompt 0's rows (kept), minibatch 1 = prompt 1's (dropped: rewards 3 3 3)
    plan = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])]
    keep = torch.tensor([True] * 3 + [False] * 3)
    adv = torch.tensor(GROUP0 + [0.0] * 3, dtype=torch.float64)[:, None] * exp.response_mask
    models = rl_rollout.PPOModels(actor, None, None, None, None, None)
    settings, shuffle = PolicyLossSettings.of(cfg), iteration.Plan(torch.Generator().manual_seed(0), plan)
    stats = iteration.update(models, iteration.UpdateInputs(exp, adv, keep=keep), cfg, settings, shuffle)
    assert (actor.backwards, actor.steps, stats["skipped_steps"]) == (1, 1, 1.0)
    # nothing anywhere: no step at all, and the weights are exactly as they were (no momentum, no decay)
    actor = CountingActor(before.clone())
    models = rl_rollout.PPOModels(actor, None, None, None, None, None)
    nothing = iteration.UpdateInputs(exp, adv, keep=torch.zeros(6, dtype=torch.bool))
    stats = iteration.update(models, nothing, cfg, settings, shuffle._replace(gen=torch.Generator().manual_seed(0)))
    assert (actor.backwards, actor.steps, stats["skipped_steps"]) == (0, 0, 2.0)
    assert torch.equal(actor.table, before) and "policy_loss" not in stats


def test_a_rank_with_nothing_steps_with_a_zero_loss_while_another_rank_has_rows(monkeypatch):
    """Every rank must take the same steps (a ZeRO step is collective): with another rank counting 5 tokens
    this rank, whose rows are all dropped, still runs backward and step, and its loss adds nothing."""
    fake_ranks(monkeypatch, [5.0])
    monkeypatch.setattr(loop, "check_finite", lambda losses: None)  # its flags' all_reduce is not faked here
    _, exp = hand_experience(REWARDS)
    actor = CountingActor(torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    before = actor.table.detach().clone()
    cfg = PPOConfig(
        algorithm="grpo",
        samples_per_prompt=3,
        reward_clip=10,
        drop_equal_reward_groups=True,
        micro_batch_size=6,
        ppo_epochs=1,
    )
    adv = torch.ones_like(exp.logprobs)
    models = rl_rollout.PPOModels(actor, None, None, None, None, None)
    inputs = iteration.UpdateInputs(exp, adv, keep=torch.zeros(6, dtype=torch.bool))
    plan = iteration.Plan(torch.Generator().manual_seed(0))
    stats = iteration.update(models, inputs, cfg, PolicyLossSettings.of(cfg), plan)
    assert (actor.backwards, actor.steps, stats["skipped_steps"], stats["policy_loss"]) == (1, 1, 0.0, 0.0)
    assert torch.equal(actor.table, before)  # a zero gradient, and plain SGD has no momentum


# --- unscored responses -------------------------------------------------------------------------------------


def test_unscored_responses_join_no_group_statistic_and_get_advantage_zero():
    # group 0: 1, (unscored), 3, 6 ; group 1: (unscored), 4, (unscored), (unscored) ; group 2: 2, 2, 5, 1
    rewards = torch.tensor([1.0, 0.0, 3.0, 6.0, 0.0, 4.0, 0.0, 0.0, 2.0, 2.0, 5.0, 1.0], dtype=torch.float64)
    scored = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    # group 0 over 1 3 6: mean 10/3, unbiased std sqrt(((7/3)^2 + (1/3)^2 + (8/3)^2) / 2) = sqrt(19/3)
    s0 = math.sqrt(19 / 3)
    # group 2 over 2 2 5 1: mean 2.5, std sqrt((0.25 + 0.25 + 6.25 + 2.25) / 3) = sqrt(3)
    s2 = math.sqrt(3)
    expected = [(1 - 10 / 3) / (s0 + GRPO_EPS), 0.0, (3 - 10 / 3) / (s0 + GRPO_EPS), (6 - 10 / 3) / (s0 + GRPO_EPS)]
    expected += [0.0, 0.0, 0.0, 0.0]  # a group with one scored response has nothing to be relative to
    expected += [(r - 2.5) / (s2 + GRPO_EPS) for r in (2.0, 2.0, 5.0, 1.0)]
    assert grpo_advantages(rewards, 4, scored=scored).tolist() == pytest.approx(expected, abs=1e-9)
    assert group_std(rewards, 4, scored).tolist() == pytest.approx([s0, 0.0, s2], abs=1e-12)
    # rloo: the baseline of a scored response is the mean of its group's OTHER scored responses
    loo = [1 - 4.5, 0.0, 3 - 3.5, 6 - 2.0, 0.0, 0.0, 0.0, 0.0, 2 - 8 / 3, 2 - 8 / 3, 5 - 5 / 3, 1 - 3.0]
    assert rloo_advantages(rewards, 4, scored).tolist() == pytest.approx(loo, abs=1e-12)
    # batch scale: the std of the nine scored rewards (1 3 6 4 2 2 5 1 and... ) not of the twelve
    kept = rewards[scored]
    centered = [e * (s0 + GRPO_EPS) for e in expected[:4]] + [0.0] * 4 + [e * (s2 + GRPO_EPS) for e in expected[8:]]
    batch = grpo_advantages(rewards, 4, scale="batch", scored=scored)
    assert batch.tolist() == pytest.approx([c / (float(kept.std()) + GRPO_EPS) for c in centered], abs=1e-9)
    # all scored: the same numbers as without the mask
    everything = torch.ones(12, dtype=torch.bool)
    assert grpo_advantages(rewards, 4, scored=everything).tolist() == pytest.approx(
        grpo_advantages(rewards, 4).tolist(), abs=1e-12
    )


def test_group_targets_and_the_reward_mean_leave_unscored_rows_out():
    _, exp = hand_experience(torch.tensor([1.0, 0.0, 3.0, 3.0, 3.0, 3.0]))
    scored = torch.tensor([True, False, True, True, True, True])
    exp = exp._replace(scored=scored)
    cfg = PPOConfig(algorithm="grpo", samples_per_prompt=3, reward_clip=10, drop_equal_reward_groups=True)
    targets = group_targets(exp, cfg, beta=0.1)
    # group 0 over 1 and 3: mean 2, std sqrt(2); the unscored row 0. Group 1: equal rewards, dropped.
    a = 1 / (math.sqrt(2) + GRPO_EPS)
    assert targets.advantages[:, 2].tolist() == pytest.approx([-a, 0.0, a, 0.0, 0.0, 0.0], abs=1e-6)
    assert targets.keep.tolist() == [True] * 3 + [False] * 3
    assert targets.metrics["group_reward_std"] == pytest.approx(math.sqrt(2) / 2)
    mean, _, count = global_stats(exp.scores[exp.scored])
    assert (mean, count) == (pytest.approx(13 / 5), 5)


def test_scored_rows_by_hand():
    values = [[1.0, None, None], [None, 0.0, None]]
    assert scored_rows(False, values, 3) == [True, True, False]
    assert scored_rows(True, values, 3) == [True, True, True]  # the reward model scores every response
    assert scored_rows(False, [], 2) == [False, False]


@pytest.fixture
def fns(tmp_path: Path) -> Path:
    (tmp_path / "fns.py").write_text(FUNCTIONS, encoding="utf-8")
    return tmp_path


def test_the_scorer_marks_what_no_function_scored_and_refuses_misaligned_rows(fns: Path):
    ids = torch.tensor([[5, ord("r"), 0], [5, ord("w"), 0], [5, ord("r"), 0]])
    attention = torch.ones(3, 3, dtype=torch.long)
    response = torch.tensor([[1, 1], [1, 0], [1, 1]])
    rows = phases.Rows(["p"] * 3, {"answer": ["r", None, "x"]}, ORIGINS)
    rewards = RewardsConfig(functions=[{"path": "fns.py:exact"}])
    with FunctionRunner(definitions.resolve(rewards, str(fns)), 10) as runner:
        scorer = Scorer(None, 1.0, runner, CharTokenizer())
        scores, scored, parts = scorer.scored(ids, attention, response, rows)
        assert scores.tolist() == [1.0, 0.0, 0.0] and scored.tolist() == [True, False, True]
        assert parts.per_function == {"exact": [1.0, None, 0.0]} and parts.total == scores.tolist()
        with pytest.raises(ValueError, match=r"^reward scoring: 2 data rows for 3 completions; expected one row per"):
            scorer.score(ids, attention, response, rows.take([0, 1]))


# --- pinned by hand: each row of the clipped loss, pooled statistics ------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "clipped"),
    [
        (1.5, 1.0, -1.2, True),  # A > 0, r above 1 + eps: the clip caps the gain at 1.2
        (0.5, 1.0, -0.5, False),  # A > 0, r below 1 - eps: the unclipped (smaller) gain is the max loss
        (0.5, -1.0, 0.8, True),  # A < 0, r below 1 - eps: the clip keeps the penalty at 0.8
        (1.5, -1.0, 1.5, False),  # A < 0, r above 1 + eps: the unclipped penalty
        (1.1, 2.0, -2.2, False),  # inside the trust region: -A r
    ],
)
def test_each_row_of_the_clipped_loss(ratio, advantage, loss, clipped):
    from kubealign.rl.losses import policy_loss

    # one response of two tokens, the second outside the response (its ratio would be huge)
    logprobs = torch.tensor([[math.log(ratio), 5.0]], dtype=torch.float64)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1, 0]])
    adv = torch.tensor([[advantage, 9.0]], dtype=torch.float64)
    out = policy_loss(logprobs, old, adv, mask, PolicyLossSettings(cliprange=0.2))
    assert out.loss.item() == pytest.approx(loss)
    assert out.clip_fraction.item() == float(clipped)
    assert out.approx_kl.item() == pytest.approx((ratio - 1) - math.log(ratio))


def test_pooled_statistics_with_a_faked_second_rank(monkeypatch):
    fake_ranks(monkeypatch, [3.0 + 4.0, 9.0 + 16.0, 2.0])  # the other rank holds 3 and 4
    mean, std, count = global_stats(torch.tensor([1.0, 2.0, 5.0]))
    values = [1.0, 2.0, 5.0, 3.0, 4.0]
    by_hand = sum(values) / 5
    assert (mean, count) == (pytest.approx(by_hand), 5)
    assert std == pytest.approx(math.sqrt(sum((v - by_hand) ** 2 for v in values) / 4))


def test_batch_scale_divides_by_the_std_pooled_over_every_rank_in_the_update_path(monkeypatch):
    """group_targets (what iteration() trains on) with scale_rewards batch: the std is every rank's rewards',
    as TRL gathers them before scaling; this rank's alone (sqrt(7 * 0.8) here) would be another number."""
    actor, exp = hand_experience(REWARDS)  # this rank: 1 2 6 | 3 3 3
    other = [10.0, 20.0, 30.0, 0.0, 0.0, 0.0]  # the other rank's rewards
    calls = fake_ranks(monkeypatch, [sum(other), sum(r * r for r in other), float(len(other))])
    cfg = PPOConfig(algorithm="grpo", samples_per_prompt=3, reward_clip=100, scale_rewards="batch")
    targets = group_targets(exp, cfg, beta=0.0)
    assert calls[0][2] == 6.0  # the first pooled statistic is the batch std's: this rank's six rewards
    pooled = REWARDS.tolist() + other
    mean = sum(pooled) / 12
    std = math.sqrt(sum((r - mean) ** 2 for r in pooled) / 11)
    mine = float(REWARDS.std())
    assert abs(std - mine) > 1
    expected = [c / (std + GRPO_EPS) for c in (-2.0, -1.0, 3.0, 0.0, 0.0, 0.0)]
    # each response token carries its row's advantage
    assert targets.advantages.sum(-1).tolist() == pytest.approx(
        [e * n for e, n in zip(expected, lengths(exp), strict=True)], abs=1e-5
    )


def test_batch_scale_with_one_or_two_scored_rewards_and_the_defaults():
    rewards = torch.tensor([1.0, 5.0, 2.0, 7.0], dtype=torch.float64)
    one = torch.tensor([True, False, False, False])
    assert grpo_advantages(rewards, 2, scale="batch", scored=one).tolist() == [0.0] * 4  # nothing relative: 0, finite
    two = torch.tensor([True, True, False, False])  # group 0 scored (1 and 5), group 1 not at all
    std = math.sqrt(((1 - 3) ** 2 + (5 - 3) ** 2) / 1)  # the batch std of the two scored rewards
    assert grpo_advantages(rewards, 2, scale="batch", scored=two).tolist() == pytest.approx(
        [-2 / (std + GRPO_EPS), 2 / (std + GRPO_EPS), 0.0, 0.0]
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert loss_denominator(mask) == 3  # the default is token
    assert aggregate(torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]), mask).item() == pytest.approx(6 / 3)


def test_a_scorer_without_functions_has_no_specs_and_no_function_values():
    from tests.rl.test_experience import TokenValue  # value at position t: 10 * token + t

    scorer = Scorer(TokenValue(), 1.0, None, CharTokenizer())
    scores = scorer.score(torch.tensor([[5, 6]]), torch.ones(1, 2), torch.ones(1, 1), None)
    assert (scorer.specs, scores.per_function, scores.total) == ([], {}, [61.0])  # the RM alone: 10 * 6 + 1
