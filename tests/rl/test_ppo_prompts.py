"""Prompts as PPO and evaluation encode them: one BOS, whether the tokenizer or a chat template adds it."""

from __future__ import annotations

import pytest

from kubealign.data.tokenize import encode_pair, encode_prompt
from kubealign.models import loading


@pytest.fixture()
def bos_tokenizer():
    """The tiny tokenizer, made to add BOS to every encoding (as Llama's and many others' do)."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = loading.load_tokenizer("tiny-opt")
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    bos = (tokenizer.bos_token, tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
    )
    assert tokenizer("hi")["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


def test_plain_prompt_keeps_the_tokenizers_bos(bos_tokenizer):
    ids = encode_prompt(bos_tokenizer, "\n\nHuman: hi\n\nAssistant:")
    assert ids[0] == bos_tokenizer.bos_token_id and ids.count(bos_tokenizer.bos_token_id) == 1


def test_a_chat_template_with_its_own_bos_gets_no_second_one(bos_tokenizer):
    bos_tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids = encode_prompt(bos_tokenizer, "\n\nHuman: hi\n\nAssistant:")
    assert ids[0] == bos_tokenizer.bos_token_id and ids.count(bos_tokenizer.bos_token_id) == 1
    assert bos_tokenizer.decode(ids[1:]) == "<|user|>hi<|assistant|>"
    pair = encode_pair(bos_tokenizer, "\n\nHuman: hi\n\nAssistant:", " ok", 64)
    assert pair.input_ids.count(bos_tokenizer.bos_token_id) == 1


def test_prompts_cut_from_the_left_keep_their_bos(bos_tokenizer):
    from kubealign.data.tokenize import cut_left
    from kubealign.stages.ppo import encode_prompts

    bos = bos_tokenizer.bos_token_id
    assert cut_left([bos, 5, 6, 7, 8], 3, bos) == [bos, 7, 8]
    assert cut_left([5, 6, 7, 8], 3, bos) == [6, 7, 8]  # no BOS to keep
    assert cut_left([bos, 5, 6], 3, bos) == [bos, 5, 6]  # short enough: unchanged
    long = "\n\nHuman: " + "word " * 60 + "LAST\n\nAssistant:"
    (ids,) = encode_prompts({"prompt": [long]}, bos_tokenizer, 16)
    assert len(ids) == 16 and ids[0] == bos and ids.count(bos) == 1
    assert bos_tokenizer.decode(ids[1:]).endswith("LAST\n\nAssistant:")
    pair = encode_pair(bos_tokenizer, long, " ok", 24)
    assert len(pair.input_ids) == 24 and pair.input_ids[0] == bos
    assert bos_tokenizer.decode(pair.input_ids[pair.prompt_len :]) == " ok</s>"
