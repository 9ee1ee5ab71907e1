"""One prompt/response/EOS convention for every stage."""

from __future__ import annotations

import pytest

from kubealign.data.tokenize import encode_pair, pad_batch, plain_to_messages, prompt_text
from kubealign.models import loading


@pytest.fixture(scope="module")
def tokenizer():
    return loading.load_tokenizer("tiny-opt")


def test_plain_dialogue_parses_to_messages():
    prompt = "\n\nSystem: Be nice.\n\nHuman: a?\n\nAssistant: b\n\nHuman: c?\n\nAssistant:"
    assert plain_to_messages(prompt) == [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "a?"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c?"},
    ]
    assert plain_to_messages("just text") == [{"role": "user", "content": "just text"}]


def test_response_ends_with_exactly_one_eos(tokenizer):
    enc = encode_pair(tokenizer, "\n\nHuman: hi\n\nAssistant:", " Happy to help!", 64)
    assert enc.input_ids[-1] == tokenizer.eos_token_id
    assert enc.input_ids.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(enc.input_ids[: enc.prompt_len]) == "\n\nHuman: hi\n\nAssistant:"
    assert tokenizer.decode(enc.input_ids[enc.prompt_len : -1]) == " Happy to help!"


def test_truncation_keeps_the_response_and_the_end_of_the_prompt(tokenizer):
    prompt = "\n\nHuman: " + "word " * 100 + "LAST\n\nAssistant:"
    enc = encode_pair(tokenizer, prompt, " Of course!", 24)
    assert len(enc.input_ids) == 24
    assert tokenizer.decode(enc.input_ids[enc.prompt_len :]) == " Of course!</s>"
    assert tokenizer.decode(enc.input_ids[: enc.prompt_len]).endswith("LAST\n\nAssistant:")
    long = encode_pair(tokenizer, "\n\nHuman: q\n\nAssistant:", " x" * 200, 24)
    assert len(long.input_ids) == 24 and long.input_ids[-1] == tokenizer.eos_token_id


def test_chat_template_is_used_when_present(tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert prompt_text(tokenizer, "\n\nHuman: hi\n\nAssistant:") == "<|user|>hi<|assistant|>"


def test_pad_batch_sides():
    assert pad_batch([[1, 2], [3]], 0) == ([[1, 2], [3, 0]], [[1, 1], [1, 0]])
    assert pad_batch([[1, 2], [3]], 0, side="left") == ([[1, 2], [0, 3]], [[1, 1], [0, 1]])
