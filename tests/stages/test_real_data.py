"""Real data at real lengths and precisions: HH-RLHF dialogues cut at a max_seq_len that truncates most
pairs, through data-split, reward and DPO (PPO and GRPO in bf16 with top-k and top-p: tests/stages/test_ppo.py,
beside the SFT and reward models they share). The assertions
are properties of what the stages trained on (every pair's two sequences start with the same prompt ids;
no response cut for length ends with EOS) and of their results (finite), not numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kubealign.models import loading
from kubealign.stages import dpo, reward
from tests.conftest import NO_TRACKING
from tests.stages.test_training import result_of

pytestmark = pytest.mark.integration

MAX_LEN = 48  # HH-RLHF's dialogues run to hundreds of tokens: nearly every pair is cut here


def spy(monkeypatch: pytest.MonkeyPatch, module, seen: list) -> None:
    """Record what module.tokenize gives the stage, unchanged."""
    real = module.tokenize

    def recording(rows, tokenizer, max_len):
        out = real(rows, tokenizer, max_len)
        seen.append((rows, out))
        return out

    monkeypatch.setattr(module, "tokenize", recording)


def check_pairs(seen: list, tokenizer, sequences) -> tuple[int, int]:
    """Assert the properties on every recorded pair; returns (pairs, pairs with a response cut)."""
    from kubealign.data.tokenize import MIN_PROMPT_TOKENS, encode_prompt

    eos, room = tokenizer.eos_token_id, MAX_LEN - MIN_PROMPT_TOKENS
    pairs = cut = 0
    for rows, out in seen:
        for (chosen, rejected), prompt, texts in zip(
            map(sequences, out), rows["prompt"], zip(rows["chosen"], rows["rejected"], strict=True), strict=True
        ):
            pairs += 1
            wholes = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
            starts = []
            for seq, whole in zip((chosen, rejected), wholes, strict=True):
                assert len(seq) <= MAX_LEN
                response = whole[:room]  # cut at its end, EOS and all, when over the room
                start = len(seq) - len(response)
                assert seq[start:] == response
                if len(whole) > room:  # cut for length: it does not end with EOS
                    assert response[-1] != eos and eos not in response
                else:
                    assert response[-1] == eos and response.count(eos) == 1
                starts.append(start)
            cut += any(len(w) > room for w in wholes)
            # The prompt is cut once: both sequences start with the same prompt ids, the end of the prompt's.
            assert starts[0] == starts[1] and chosen[: starts[0]] == rejected[: starts[1]], prompt[-80:]
            ids, kept = encode_prompt(tokenizer, prompt), starts[0]
            lead = [ids[0]] if ids[0] == tokenizer.bos_token_id and kept < len(ids) else []  # a BOS stays in front
            assert chosen[:kept] == lead + ids[len(ids) - kept + len(lead) :]
    return pairs, cut


@pytest.fixture(scope="module")
def hh_split(tmp_path_factory) -> Path:
    from tests.conftest import HH_FILE

    if not HH_FILE.exists():
        pytest.skip(f"real-data file {HH_FILE} is absent (../shared/data is not beside the repo)")
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("hh") / "split"
    assert main(["data-split", "--source", str(HH_FILE), "--set", NO_TRACKING, "--output", str(out)]) == 0
    return out


def reward_pair(pair):
    return pair  # reward.tokenize: (chosen ids, rejected ids)


def dpo_pair(pair):
    # dpo.tokenize: the loss masks mark exactly the response tokens, which start at one place on both sides
    assert pair["chosen"]["loss_mask"].index(1) == pair["rejected"]["loss_mask"].index(1)
    return pair["chosen"]["input_ids"], pair["rejected"]["input_ids"]


@pytest.mark.parametrize(("stage", "module", "sequences"), [("reward", reward, reward_pair), ("dpo", dpo, dpo_pair)])
def test_real_hh_pairs_compare_answers_to_one_prompt(cli, hh_split, tmp_path, monkeypatch, stage, module, sequences):
    seen: list = []
    spy(monkeypatch, module, seen)
    out = tmp_path / stage
    args = ["--set", f"{stage}.max_seq_len={MAX_LEN}", "--set", f"{stage}.num_train_epochs=0.2", "--set", NO_TRACKING]
    result = cli(stage, "--data", hh_split, *args, "--output", out)
    assert result.code == 0, result.err
    pairs, cut = check_pairs(seen, loading.load_tokenizer("tiny-opt"), sequences)
    assert pairs > 500 and cut > pairs / 2  # most pairs have a response cut: the case the rule is for
    assert all(math.isfinite(v) for v in result_of(out)["metrics"].values() if isinstance(v, float))
