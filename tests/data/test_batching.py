"""Padding-free batches (kubealign.data.batching): the plan by hand, and exactness on HH-RLHF rows at their
real lengths: a grouped batch gives every sequence the log-probs, scores and losses the padded batch gives,
a step's loss does not depend on how its sequences were grouped, and DPO's first loss is ln 2 in every
grouped batch against the reference table computed in other (longest-first) batches."""

from __future__ import annotations

import contextlib
import gzip
import json
import math

import pytest
import torch

from kubealign.data import batching, schemas
from kubealign.data.tokenize import encode_preference

# --- the plan, by hand ---------------------------------------------------------------------------------

ZIGZAG = [1, 100, 2, 99, 3, 98, 4, 97]  # the only way to pair them with little padding is by length


def as_sets(plan: batching.Plan) -> list[frozenset[int]]:
    return [frozenset(i for rank in batch for i in rank) for batch in plan]


def test_grouped_pairs_sequences_of_similar_length():
    plan = batching.epoch_plan(ZIGZAG, 2, 1, 1, seed=0, epoch=0, mode="grouped")
    # longest first within the window: (100, 99), (98, 97), (4, 3), (2, 1) -> indices
    assert sorted(as_sets(plan), key=min) == sorted(
        [frozenset({1, 3}), frozenset({5, 7}), frozenset({6, 4}), frozenset({2, 0})], key=min
    )
    assert batching.padding_share(ZIGZAG, [b[0] for b in plan]) == pytest.approx(1 - 404 / 408)
    padded = batching.epoch_plan(ZIGZAG, 2, 1, 1, seed=0, epoch=0, mode="padded")
    assert sorted(i for b in padded for i in b[0]) == list(range(8))
    assert batching.padding_share(ZIGZAG, [b[0] for b in padded]) > 0.2


def test_ranks_split_a_global_micro_batch_longest_first():
    plan = batching.epoch_plan(ZIGZAG, 1, 2, 1, seed=3, epoch=0, mode="grouped")
    ranks = {tuple(sorted(ZIGZAG[r[0]] for r in batch)): [ZIGZAG[r[0]] for r in batch] for batch in plan}
    assert ranks == {(99, 100): [100, 99], (97, 98): [98, 97], (3, 4): [4, 3], (1, 2): [2, 1]}


def test_the_plan_is_a_function_of_seed_and_epoch():
    lengths = [(7 * i) % 23 + 1 for i in range(40)]
    plan = batching.epoch_plan(lengths, 4, 1, 2, seed=5, epoch=1, mode="grouped")
    assert plan == batching.epoch_plan(lengths, 4, 1, 2, seed=5, epoch=1, mode="grouped")
    assert plan != batching.epoch_plan(lengths, 4, 1, 2, seed=5, epoch=2, mode="grouped")
    assert plan != batching.epoch_plan(lengths, 4, 1, 2, seed=6, epoch=1, mode="grouped")
    # whole steps only: 40 rows in steps of 4 x 2 = 5 steps, 10 micro-batches, each row at most once
    assert len(plan) == 10 and all(len(b[0]) == 4 for b in plan)
    flat = [i for b in plan for i in b[0]]
    assert len(set(flat)) == 40
    odd = batching.epoch_plan(lengths[:39], 4, 1, 2, seed=5, epoch=1, mode="grouped")
    assert len(odd) == 8  # 39 rows: 4 whole steps; the 7 left over wait for the next epoch's shuffle


def test_sorting_stays_inside_a_window(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(batching, "WINDOW", 2)  # windows of 2 micro-batches of 2: 4 examples sorted together
    lengths = [10 * (i + 1) for i in range(8)]
    order = torch.randperm(8, generator=torch.Generator().manual_seed(11)).tolist()  # the plan's first draw
    expected = set()
    for start in (0, 4):
        window = sorted(order[start : start + 4], key=lambda i: -lengths[i])
        expected |= {frozenset(window[:2]), frozenset(window[2:])}
    plan = batching.epoch_plan(lengths, 2, 1, 1, seed=11, epoch=0, mode="grouped")
    assert set(as_sets(plan)) == expected
    assert expected != {frozenset({7, 6}), frozenset({5, 4}), frozenset({3, 2}), frozenset({1, 0})}  # not global


def test_grouped_micro_batches_come_in_shuffled_order():
    lengths = list(range(1, 81))  # one window: sorted, it would start with the longest micro-batch
    plan = batching.epoch_plan(lengths, 2, 1, 1, seed=4, epoch=0, mode="grouped")
    tops = [max(lengths[i] for i in b[0]) for b in plan]
    assert sorted(tops, reverse=True) == list(range(80, 0, -2))  # the micro-batches are the sorted pairs ...
    assert tops != sorted(tops, reverse=True) and tops != sorted(tops)  # ... in a shuffled order


def test_a_pair_pads_to_its_longer_sequence():
    from kubealign.stages import dpo, reward

    assert reward.pair_length(([1, 2], [1, 2, 3, 4, 5])) == 5 and reward.pair_length(([1, 2, 3], [1])) == 3
    pair = {"chosen": {"input_ids": [1, 2]}, "rejected": {"input_ids": [1, 2, 3, 4]}}
    assert dpo.pair_length(pair) == 4
    assert dpo.pair_length({"chosen": pair["rejected"], "rejected": pair["chosen"]}) == 4


def test_step_units_sum_a_whole_step_over_ranks():
    plan = [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    units = [1, 2, 4, 8, 16, 32, 64, 128]
    assert batching.step_units(plan, units, 2) == [15, 240]
    assert batching.step_units(plan, units, 1) == [3, 12, 48, 192]


def test_padding_share_and_sorted_batches_by_hand():
    assert batching.padding_share([2, 4], [[0, 1]]) == pytest.approx(0.25)
    assert batching.padding_share([2, 4, 3], [[0], [1, 2]]) == pytest.approx(1 - 9 / 10)
    assert batching.sorted_batches([3, 1, 2, 5], 2) == [[3, 0], [2, 1]]
    with pytest.raises(ValueError, match="batching mode 'packed'"):
        batching.epoch_plan([1], 1, 1, 1, 0, 0, "packed")


# --- exactness on HH rows ------------------------------------------------------------------------------

ROWS = 24


@pytest.fixture(scope="module")
def hh_pairs():
    from kubealign.models import loading
    from tests.conftest import HH_FILE

    if not HH_FILE.exists():
        pytest.skip(f"real-data file {HH_FILE} is absent (../shared/data is not beside the repo)")
    tokenizer = loading.load_tokenizer("tiny-opt")
    pairs = []
    with gzip.open(HH_FILE, "rt", encoding="utf-8") as handle:
        for line in handle:
            p = schemas.normalize(json.loads(line))
            if p.chosen and p.rejected and p.chosen != p.rejected:
                pairs.append(encode_preference(tokenizer, p.prompt, p.chosen, p.rejected, 512))
            if len(pairs) == ROWS:
                break
    return tokenizer, pairs


@pytest.fixture(scope="module")
def policy():
    from kubealign.models import loading

    torch.manual_seed(0)
    model = loading.load_causal_lm("tiny-opt")
    model.eval()  # no dropout: the same sequence must give the same numbers in any batch
    return model


def grouped_batches(lengths: list[int], micro: int) -> list[list[int]]:
    return [b[0] for b in batching.epoch_plan(lengths, micro, 1, 1, seed=1, epoch=0, mode="grouped")]


@pytest.mark.integration  # tiny models run for seconds to minutes: not the fast tier
def test_hh_lengths_vary_and_grouping_removes_most_padding(hh_pairs):
    _, pairs = hh_pairs
    lengths = [len(c.input_ids) for c, _ in pairs]
    assert max(lengths) > 3 * min(lengths)  # real lengths, not the synthetic task's
    padded = batching.padding_share(lengths, [list(range(ROWS))])
    grouped = batching.padding_share(lengths, grouped_batches(lengths, 4))
    assert padded > 0.4 and grouped < padded / 2


@pytest.mark.integration  # tiny models run for seconds to minutes: not the fast tier
def test_grouped_sequences_get_the_padded_batchs_logprobs_and_scores(hh_pairs, policy):
    from kubealign.models.value_head import last_token_scores
    from kubealign.stages import dpo

    tokenizer, pairs = hh_pairs
    examples = [{"index": i, "chosen": lm_example(c), "rejected": lm_example(r)} for i, (c, r) in enumerate(pairs)]
    with torch.no_grad():
        whole = dpo.response_logprobs(policy, dpo.collate(examples, tokenizer.pad_token_id))
        lengths = [dpo.pair_length(e) for e in examples]
        per_index = {}
        for batch in grouped_batches(lengths, 4):
            seq = dpo.response_logprobs(policy, dpo.collate([examples[i] for i in batch], tokenizer.pad_token_id))
            for k, i in enumerate(batch):
                per_index[i] = (seq.total[k], seq.total[k + len(batch)], seq.tokens[k])
        assert sorted(per_index) == list(range(ROWS))
        for i, (chosen, rejected, tokens) in per_index.items():
            assert abs(float(chosen - whole.total[i])) < 1e-5 * max(1.0, abs(float(chosen)))
            assert abs(float(rejected - whole.total[i + ROWS])) < 1e-5 * max(1.0, abs(float(rejected)))
            assert tokens == whole.tokens[i]
        # the last real token's hidden state (what a reward model scores) is the same too
        full = dpo.collate(examples, tokenizer.pad_token_id)
        hidden = policy(input_ids=full["input_ids"], attention_mask=full["attention_mask"], output_hidden_states=True)
        scores = last_token_scores(hidden.hidden_states[-1][..., 0], full["attention_mask"])
        for batch in grouped_batches(lengths, 4):
            part = dpo.collate([examples[i] for i in batch], tokenizer.pad_token_id)
            out = policy(input_ids=part["input_ids"], attention_mask=part["attention_mask"], output_hidden_states=True)
            got = last_token_scores(out.hidden_states[-1][..., 0], part["attention_mask"])
            assert torch.allclose(got[: len(batch)], scores[batch], atol=1e-5)


def lm_example(enc) -> dict[str, list[int]]:
    from kubealign.training import lm

    return lm.example(enc, include_prompt=False)


def accumulated_grads(model, batches: list[list[dict]], pad: int, per_step: bool) -> list[torch.Tensor]:
    """Gradients of one optimizer step over `batches` (micro-batches), as DeepSpeed accumulates them:
    each micro-batch's loss divided by the accumulation count."""
    from kubealign.training import lm

    model.zero_grad()
    total = sum(lm.loss_tokens(e) for b in batches for e in b)
    for examples in batches:
        batch = lm.collate(examples, pad)
        if per_step:
            batch["step_units"] = torch.tensor(float(total))
        loss = lm.step_loss(lm.batch_loss(model, batch, fp32=True), batch, len(batches))
        (loss / len(batches)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_steps_sft_loss_does_not_depend_on_the_grouping(hh_pairs, policy):
    tokenizer, pairs = hh_pairs
    distinct = {sum(e["loss_mask"][1:]): e for e in (lm_example(c) for c, _ in pairs)}
    examples = list(distinct.values())[:4]
    tokens = [sum(e["loss_mask"][1:]) for e in examples]
    assert len(set(tokens)) == 4  # different response lengths: a mean per micro-batch would weigh them apart
    pad = tokenizer.pad_token_id
    one = accumulated_grads(policy, [examples], pad, per_step=True)
    for grouping in ([[0, 1], [2, 3]], [[0, 3], [1, 2]], [[2], [0, 1, 3]]):
        batches = [[examples[i] for i in group] for group in grouping]
        got = accumulated_grads(policy, batches, pad, per_step=True)
        assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(got, one, strict=True)), grouping
    # the micro-batch mean (no step_units) is what would differ: the test can tell them apart
    meaned = accumulated_grads(policy, [[examples[0], examples[1]], [examples[2], examples[3]]], pad, per_step=False)
    assert not all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(meaned, one, strict=True))


@pytest.mark.integration  # tiny models run for seconds to minutes: not the fast tier
def test_dpo_first_loss_is_ln2_in_every_grouped_batch(hh_pairs, policy):
    from kubealign.config.train import DPOConfig
    from kubealign.stages import dpo
    from kubealign.training import distributed

    distributed.init()
    tokenizer, pairs = hh_pairs
    examples = [{"index": i, "chosen": lm_example(c), "rejected": lm_example(r)} for i, (c, r) in enumerate(pairs)]
    pad = tokenizer.pad_token_id
    # the table's batches are longest first (shard_batches with pair_length), the training batches grouped
    table = dpo.ReferenceTable(examples, pad, 6, lambda engine: contextlib.nullcontext(engine))
    engine = EngineLike(policy)
    loss = dpo.train_loss(DPOConfig(), table)
    lengths = [dpo.pair_length(e) for e in examples]
    with torch.no_grad():
        for batch in grouped_batches(lengths, 4):
            out = loss(engine, dpo.collate([examples[i] for i in batch], pad))
            assert abs(float(out.value) - math.log(2)) < 1e-5


class EngineLike(torch.nn.Module):
    """The policy with the one engine method the DPO loss asks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)

    def is_gradient_accumulation_boundary(self) -> bool:
        return True


def test_ppo_rollout_batches_group_prompts_by_length():
    from kubealign.config.schema import PPOConfig
    from kubealign.stages.ppo import prompt_order

    lengths = ZIGZAG * 2  # 16 prompts, each length twice
    padded = PPOConfig(generation_batch_size=2, seed=3, batching="padded")
    for step in range(8):  # two epochs of 4 steps of 2 ranks x 2 prompts
        epoch, j = divmod(step, 4)
        order = torch.randperm(16, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        for rank in (0, 1):  # the plain seeded permutation, cut per step and rank, as the stage always drew it
            assert prompt_order(lengths, step, padded, rank, 2) == order[j * 4 + rank * 2 : j * 4 + rank * 2 + 2]
    grouped = padded.model_copy(update={"batching": "grouped"})
    seen = []
    for step in range(4):
        for rank in (0, 1):
            batch = prompt_order(lengths, step, grouped, rank, 2)
            assert lengths[batch[0]] == lengths[batch[1]]  # sorted together: equal lengths share a rollout batch
            seen += batch
    assert sorted(seen) == list(range(16))
    # a global batch of 4 is the window's longest 4 first: (100, 100, 99, 99) -> rank 0 the 100s
    firsts = {tuple(lengths[i] for i in prompt_order(lengths, s, grouped, 0, 2)) for s in range(4)}
    assert firsts == {(100, 100), (98, 98), (4, 4), (2, 2)}


def test_the_loop_hands_each_micro_batch_its_steps_token_count(tmp_path):
    from kubealign.config.train import SFTConfig
    from kubealign.training import lm, loop

    sizes = (3, 9, 4, 12, 6, 2, 7, 5)  # loss tokens: n - 1 each (the first token is never a target), 40 in all
    examples = [{"input_ids": [5] * n, "loss_mask": [0] + [1] * (n - 1)} for n in sizes]
    cfg = SFTConfig(micro_batch_size=2, gradient_accumulation_steps=2, batching="grouped", seed=1)
    task = loop.Task(
        name="sft",
        cfg=cfg,
        train=examples,
        collate=lambda b: lm.collate(b, 0),
        loss=None,
        evaluate=None,
        checkpoint_dir=tmp_path,
        length=lambda e: len(e["input_ids"]),
        units=lm.loss_tokens,
    )
    lengths = loop.example_lengths(task)
    batches = list(loop.micro_batches(task, lengths, 0, 1, epoch=0))
    assert len(batches) == 4  # two steps of two micro-batches
    for k in (0, 2):  # each micro-batch carries the loss tokens of its whole step, its partner's included
        total = sum(int(b["loss_mask"][:, 1:].sum()) for b in batches[k : k + 2])
        assert float(batches[k]["step_units"]) == float(batches[k + 1]["step_units"]) == total
    assert float(batches[0]["step_units"]) + float(batches[2]["step_units"]) == 40
    # two ranks: one step of 2 ranks x 2 micro-batches x 2; each rank's batches count the other rank's too
    for rank in (0, 1):
        mine = list(loop.micro_batches(task, lengths, rank, 2, epoch=0))
        assert len(mine) == 2 and all(float(b["step_units"]) == 40 for b in mine)
    ranks = [list(loop.micro_batches(task, lengths, r, 2, epoch=0)) for r in (0, 1)]
    rows = sorted(int(b["attention_mask"][i].sum()) for part in ranks for b in part for i in range(2))
    assert rows == sorted(sizes)  # every example once over the ranks
