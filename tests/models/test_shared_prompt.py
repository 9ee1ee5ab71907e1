"""A pair's prompt run once (models.shared_prompt, issue 56): the response log-probs and their gradients equal
the two-row path's on OPT (with project_out), LLaMA, GPT-2, a LoRA wrapper and with activation checkpointing,
for pairs whose prompts differ in length and hold an EOS, whose responses differ in length and are padded;
one packed row per pair goes through the body; pairs that do not share their prompt and a row without a
prompt take the full rows."""

from __future__ import annotations

import pytest
import torch

from kubealign.models import shared_prompt as sp
from tests.models.test_token_logprobs import EOS, PAD, V, full_path, grads, small_lm

EXACT = 1e-5


def pair_batch(seed: int = 1, prompts=(3, 6, 1), chosen=(4, 2, 3), rejected=(5, 1, 6)):
    """(input_ids, attention_mask, loss_mask) of len(prompts) pairs, dpo.collate's layout: the chosen rows, then
    the rejected rows, right-padded; an EOS inside the second prompt; every response token a target."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, V, (k,), generator=g) for k in prompts]
    heads[1][2] = EOS
    tails = [torch.randint(3, V, (k,), generator=g) for k in (*chosen, *rejected)]
    rows = [(heads[i % len(heads)], tail) for i, tail in enumerate(tails)]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), PAD)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.cat([p, r])
        attention[i, : len(p) + len(r)] = 1
        loss[i, len(p) : len(p) + len(r)] = 1
    return ids, attention, loss


def weighted(logprobs: torch.Tensor) -> torch.Tensor:
    """A sum that weighs every position differently: a shifted or permuted scatter changes it."""
    return (logprobs * torch.arange(1, logprobs.numel() + 1).view_as(logprobs)).sum()


def both_paths(model, ids, attention, loss):
    full, _ = full_path(model, ids, attention, loss)
    weighted(full).backward()
    expected = grads(model)
    shared = sp.pair_target_logprobs(model, ids, attention, loss)
    weighted(shared).backward()
    return full, shared, expected, grads(model)


@pytest.mark.parametrize("model_type", ["opt", "llama", "gpt2"])
def test_log_probs_and_gradients_equal_the_two_forward_path(model_type):
    model = small_lm(model_type)
    ids, attention, loss = pair_batch()
    assert sp.split(ids, attention, loss) is not None  # the shared path is the one taken
    full, shared, expected, got = both_paths(model, ids, attention, loss)
    assert torch.equal(shared != 0, loss[:, 1:].bool())
    assert (full - shared).abs().max() < EXACT
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        assert (grad - got[name]).abs().max() < EXACT * max(1.0, float(grad.abs().max())), name


def test_split_packs_each_pair_into_one_row_with_both_responses_after_the_prompt():
    ids, attention, loss = pair_batch()
    pairs = sp.split(ids, attention, loss)
    p, c, r = sp.PROMPT, sp.CHOSEN, sp.REJECTED
    assert pairs.segments[0].tolist() == [p] * 3 + [c] * 4 + [r] * 5  # the longest row: 3 + 4 + 5
    assert pairs.segments[1].tolist() == [p] * 6 + [c] * 2 + [r] * 1 + [sp.PAD] * 3
    assert pairs.segments[2].tolist() == [p] * 1 + [c] * 3 + [r] * 6 + [sp.PAD] * 2
    assert pairs.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7]
    assert pairs.position_ids[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 6, 0, 0, 0]
    assert pairs.input_ids[1, :9].tolist() == ids[1, :8].tolist() + [ids[4, 6].item()]
    assert pairs.input_ids[2, :10].tolist() == ids[2, :4].tolist() + ids[5, 1:7].tolist()
    # targets in the full batch's order: chosen rows, then rejected rows; each read at its predecessor
    width = pairs.input_ids.shape[1]
    assert pairs.tokens.tolist() == ids[:, 1:][loss[:, 1:].bool()].tolist()
    rejected_of_pair_2 = pairs.sources[-6:].tolist()
    assert rejected_of_pair_2 == [2 * width + 0, *(2 * width + k for k in range(4, 9))]
    chosen_of_pair_1 = pairs.sources[4:6].tolist()
    assert chosen_of_pair_1 == [width + 5, width + 6]


def test_the_mask_hides_the_chosen_response_from_the_rejected_one():
    ids, attention, loss = pair_batch()
    pairs = sp.split(ids, attention, loss)
    allowed = sp.attention_bias(pairs.segments, torch.float32)[1, 0] == 0  # pair 1: 6 + 2 + 1 tokens, 3 pads
    assert allowed[7].tolist() == [True] * 8 + [False] * 4  # the last chosen token: prompt and chosen
    assert allowed[8].tolist() == [True] * 6 + [False, False, True] + [False] * 3  # rejected: prompt, itself
    assert allowed[9].tolist() == [False] * 9 + [True, False, False]  # padding: itself only
    assert not allowed[:9, 9:].any()  # no real token sees the padding
    assert allowed[:6, :6].equal(torch.ones(6, 6, dtype=torch.bool).tril())  # the prompt: causal


def test_each_prompt_goes_through_the_body_once():
    model = small_lm("opt")
    ids, attention, loss = pair_batch()
    seen = []
    model.model.decoder.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        sp.pair_target_logprobs(model, ids, attention, loss)
    assert seen == [torch.Size([3, 12])]  # one row a pair: 3 + 4 + 5, 6 + 2 + 1 and 1 + 3 + 6 tokens
    seen.clear()
    with torch.no_grad():
        full_path(model, ids, attention, loss)
    assert seen == [ids.shape]


@pytest.mark.parametrize(
    "edit",
    ["prompt token", "prompt length", "prompt length, same next token", "no prompt", "odd rows"],
)
def test_pairs_that_share_no_prompt_take_the_full_rows(edit):
    ids, attention, loss = pair_batch()
    if edit == "prompt token":
        ids[4, 0] = ids[4, 0] % (V - 3) + 3 if ids[4, 0] != ids[1, 0] else ids[4, 0] + 1
    elif edit == "prompt length":  # the third rejected response starts one token later: a 2-token prompt
        loss[5, 1] = 0
    elif edit == "prompt length, same next token":  # ... and its 2 prompt tokens are the chosen row's first 2
        loss[5, 1], ids[5, 1] = 0, ids[2, 1]
    elif edit == "no prompt":
        loss[2, 0] = 1
    else:
        ids, attention, loss = ids[:5], attention[:5], loss[:5]
    assert sp.split(ids, attention, loss) is None
    model = small_lm("llama")
    full, _ = full_path(model, ids, attention, loss)
    with torch.no_grad():
        assert (sp.pair_target_logprobs(model, ids, attention, loss) - full).abs().max() < EXACT


def test_activation_checkpointing_trains_through_the_shared_prompt_too():
    model = small_lm("opt")
    model.activation_checkpointing_enable()
    ids, attention, loss = pair_batch()
    full, shared, expected, got = both_paths(model, ids, attention, loss)
    assert (full - shared).abs().max() < EXACT
    for name, grad in expected.items():
        assert (grad - got[name]).abs().max() < EXACT * max(1.0, float(grad.abs().max())), name


def test_a_lora_wrapper_trains_its_adapters_through_the_shared_prompt():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(small_lm("opt"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero B: the adapters change the output, so their gradient reaches A too
            torch.nn.init.normal_(p, std=0.1)
    ids, attention, loss = pair_batch(seed=3)
    assert sp.usable(model) is not None
    full, shared, expected, got = both_paths(model, ids, attention, loss)
    assert (full - shared).abs().max() < EXACT
    assert expected and all("lora_" in name for name in got)
    for name, grad in expected.items():
        assert (grad - got[name]).abs().max() < EXACT * max(1.0, float(grad.abs().max())), name


def test_an_attention_that_takes_no_custom_mask_takes_the_full_rows(caplog, monkeypatch):
    model = small_lm("llama")
    assert sp.usable(model) is not None  # sdpa (or eager): the packed rows' mask goes through
    monkeypatch.setattr(type(model.config), "_attn_implementation", property(lambda self: "flash_attention_2"))
    with caplog.at_level("WARNING"):
        assert sp.usable(model) is None
    assert "'flash_attention_2' takes no custom mask" in caplog.text
