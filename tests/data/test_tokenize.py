"""One prompt/response/EOS convention for every stage."""

from __future__ import annotations

import pytest

from kubealign.data import tokenize
from kubealign.data.tokenize import (
    MIN_PROMPT_TOKENS,
    encode_pair,
    encode_preference,
    pad_batch,
    plain_to_messages,
    prompt_text,
)
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
    # A response cut for length carries no EOS: it did not end there.
    assert len(long.input_ids) == 24 and tokenizer.eos_token_id not in long.input_ids[long.prompt_len :]
    head = tokenizer(" x" * 200, add_special_tokens=False)["input_ids"][: 24 - long.prompt_len]
    assert long.input_ids[long.prompt_len :] == head  # the response's first tokens: cut at its end


class CharTokenizer:
    """One id per character (its code point), BOS 1 in front of a prompt, EOS 2: ids that can be counted."""

    chat_template = None
    bos_token, bos_token_id, eos_token_id = "<s>", 1, 2

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def chars(ids):
    return "".join(chr(i) for i in ids if i > 2)


def test_a_preference_pair_shares_one_prompt_cut_once_for_the_longer_response():
    tok = CharTokenizer()
    # The case at max_seq_len 64: a 60-token prompt (BOS + 59), a 56-token chosen answer (55 + EOS)
    # and a 4-token rejected one (3 + EOS).
    prompt = "".join(chr(ord("a") + i % 26) for i in range(59))
    chosen, rejected = encode_preference(tok, prompt, "C" * 55, "r\x02r", 64)  # an EOS id inside the text
    assert chosen.prompt_len == rejected.prompt_len == 8  # 64 - 56: BOS + the last 7 prompt characters
    assert chosen.input_ids[:8] == rejected.input_ids[:8] == [1] + [ord(c) for c in prompt[-7:]]
    assert chosen.input_ids[8:] == [ord("C")] * 55 + [2] and len(chosen.input_ids) == 64
    assert rejected.input_ids[8:] == [ord("r"), 2, ord("r"), 2] and len(rejected.input_ids) == 12
    # Each alone (encode_pair) would have kept a different prompt for the short answer.
    assert encode_pair(tok, prompt, "r\x02r", 64).prompt_len == 60
    # The order of the two does not matter: the longer one sets the cut.
    swapped = encode_preference(tok, prompt, "r\x02r", "C" * 55, 64)
    assert swapped[0].input_ids == rejected.input_ids and swapped[1].input_ids == chosen.input_ids


@pytest.mark.parametrize("length", [54, 55, 56, 200])
def test_a_response_that_must_be_cut_has_no_eos_and_one_that_fits_has_exactly_one(length):
    tok = CharTokenizer()
    room = 64 - MIN_PROMPT_TOKENS  # 56 tokens, EOS included
    prompt = "\n\nHuman: " + "q" * 80 + "\n\nAssistant:"
    long, short = encode_preference(tok, prompt, "x" * length, "ok", 64)
    assert long.input_ids[: long.prompt_len] == short.input_ids[: short.prompt_len]
    response = long.input_ids[long.prompt_len :]
    if length + 1 <= room:  # fits with its EOS
        assert response == [ord("x")] * length + [2] and long.prompt_len == 64 - length - 1
    else:  # cut at the end; no EOS appended
        assert response == [ord("x")] * room and long.prompt_len == MIN_PROMPT_TOKENS
    assert len(long.input_ids) <= 64
    assert long.input_ids[0] == 1 and chars(long.input_ids[: long.prompt_len]) == prompt[-(long.prompt_len - 1) :]
    assert short.input_ids[short.prompt_len :] == [ord("o"), ord("k"), 2]


def test_a_pair_that_fits_keeps_the_whole_prompt():
    tok = CharTokenizer()
    chosen, rejected = encode_preference(tok, "ask", "yes", "no", 64)
    assert chosen.input_ids == [1, *map(ord, "askyes"), 2] and rejected.input_ids == [1, *map(ord, "askno"), 2]
    assert chosen.prompt_len == rejected.prompt_len == 4


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


@pytest.mark.unit
def test_a_demonstrations_tool_answers_are_encoded_alone_and_not_targets():
    from kubealign.training.lm import example
    from tests.support.chars import EOS, Chars

    chars = Chars()
    response = 'x<tool_call>{"a": 1}</tool_call><tool_response>3</tool_response>= 3'
    ids, observed = tokenize.encode_response_observed(chars, response)
    assert ids == chars.encode(response) + [EOS]
    start = response.index("<tool_response>")
    span = len("<tool_response>3</tool_response>")
    assert observed == [0] * start + [1] * span + [0] * (len(response) - start - span) + [0]
    enc = tokenize.encode_pair(chars, "Q?", response, 200)
    mask = example(enc, include_prompt=False)["loss_mask"]
    assert mask == [0] * 2 + [1] * start + [0] * span + [1] * (len(response) - start - span + 1)
    cut = tokenize.encode_pair(chars, "Q?", response, 8 + start + 3)  # cut inside the tool's answer
    assert cut.observed == (0,) * start + (1, 1, 1) and example(cut, False)["loss_mask"][-3:] == [0, 0, 0]
    assert tokenize.encode_pair(chars, "Q?", "plain 3", 200).observed == ()
