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
