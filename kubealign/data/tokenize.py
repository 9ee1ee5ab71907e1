"""Turn normalized (prompt, response) text into token ids — one convention for every stage.

* Prompt: the tokenizer's chat template when it has one (the plain-format dialogue is parsed back into
  messages and rendered with add_generation_prompt=True); otherwise the plain text as data-split wrote
  it ("\\n\\nHuman: ...\\n\\nAssistant:"). Encoded with the tokenizer's own special tokens (e.g. BOS),
  except where the rendered template already starts with BOS: one BOS, never two.
* Response: encoded without special tokens, followed by exactly one EOS token. Generation stops at
  EOS, so SFT teaches the model to emit it, the reward model scores the sequence at it, and PPO's
  rollouts end with it.
* Over max_seq_len: the response (with its EOS) keeps at most max_seq_len - MIN_PROMPT_TOKENS tokens,
  cut at its end. A response that had to be cut carries NO EOS: it did not end there, so SFT must not
  learn to stop there, the reward model scores it at its last kept token, and DPO does not credit the
  chosen answer for an ending the truncation made (DeepSpeed-Chat and TRL append nothing to a cut
  response either). The prompt takes the rest, cut from the left: the turns nearest to the response
  are kept (and a leading BOS).
* A demonstration that calls tools (rl.tool_calls' markup) holds the tools' answers as
  <tool_response>...</tool_response> spans: each span is encoded on its own (as a multi-turn rollout appends
  an observation's tokens to the model's) and marked in `observed`, so SFT does not teach the model to write
  what the tools answer (lm.example masks it, as the rollout masks it out of the loss).
* A preference pair (encode_preference) shares ONE prompt: it is cut once, for the longer of the two
  responses, so the chosen and the rejected sequence start with the same prompt ids and the reward
  model's and DPO's comparisons are of two answers to the same question.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

TURN = re.compile(r"\n\n(Human|Assistant|System): ?")
ROLES = {"Human": "user", "Assistant": "assistant", "System": "system"}
MIN_PROMPT_TOKENS = 8
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"  # a tool's answer (rl.tool_calls)
OBSERVATION = re.compile(re.escape(RESULT_OPEN) + ".*?" + re.escape(RESULT_CLOSE), re.S)


class Encoded(NamedTuple):
    input_ids: list[int]
    prompt_len: int  # tokens of the prompt at the start of input_ids
    observed: tuple[int, ...] = ()  # per response token: 1 where a tool's answer (module docstring); () none


def plain_to_messages(prompt: str) -> list[dict[str, str]]:
    """Parse "\\n\\nHuman: a\\n\\nAssistant: b\\n\\nHuman: c\\n\\nAssistant:" into chat messages
    (the trailing empty assistant turn is the generation prompt and is dropped)."""
    parts = TURN.split(prompt)
    messages = []
    for role, content in zip(parts[1::2], parts[2::2], strict=True):
        messages.append({"role": ROLES[role], "content": content.strip()})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    if not messages:  # not in the plain dialogue format: the whole text is one user turn
        messages = [{"role": "user", "content": prompt.strip()}]
    return messages


def prompt_text(tokenizer: Any, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(plain_to_messages(prompt), tokenize=False, add_generation_prompt=True)
    return prompt


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's ids with the tokenizer's special tokens, once: a chat template that renders its own
    BOS (most do: "{{ bos_token }}...") would otherwise get a second one from the tokenizer."""
    text = prompt_text(tokenizer, prompt)
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def cut_left(ids: list[int], max_len: int, bos_id: int | None) -> list[int]:
    """The last max_len tokens of ids, a leading BOS kept in front: a prompt cut from the left still
    starts the way every training sequence did."""
    if len(ids) <= max_len:
        return ids
    if bos_id is not None and ids[0] == bos_id and max_len > 1:
        return [bos_id] + ids[len(ids) - max_len + 1 :]
    return ids[len(ids) - max_len :]


def encode_response(tokenizer: Any, response: str) -> list[int]:
    return encode_response_observed(tokenizer, response)[0]


def encode_response_observed(tokenizer: Any, response: str) -> tuple[list[int], list[int]]:
    """(ids, observed): the response's ids + EOS, its tools' answers encoded on their own and flagged 1."""
    if getattr(tokenizer, "chat_template", None):
        response = response.strip()
    ids: list[int] = []
    observed: list[int] = []
    at = 0
    for span in [*OBSERVATION.finditer(response), None]:
        end = span.start() if span is not None else len(response)
        for piece, flag in ((response[at:end], 0), (span.group() if span is not None else "", 1)):
            if piece:
                tokens = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += tokens
                observed += [flag] * len(tokens)
        at = span.end() if span is not None else at
    return ids + [tokenizer.eos_token_id], observed + [0]


def fit_response(response_ids: list[int], max_seq_len: int) -> list[int]:
    """A response's ids (EOS included) cut at the end to the room a prompt leaves: a cut response ends
    where the cut fell, without EOS (module docstring)."""
    return response_ids[: max(max_seq_len - MIN_PROMPT_TOKENS, 1)]


def encode_pair(tokenizer: Any, prompt: str, response: str, max_seq_len: int) -> Encoded:
    """Prompt + response + EOS, truncated to max_seq_len as the module docstring says."""
    return encode_responses(tokenizer, prompt, [response], max_seq_len)[0]


def encode_preference(
    tokenizer: Any, prompt: str, chosen: str, rejected: str, max_seq_len: int
) -> tuple[Encoded, Encoded]:
    """(chosen, rejected) sequences of one preference pair, each at most max_seq_len tokens, whose
    input_ids[:prompt_len] are identical: the prompt is cut once, for the longer response."""
    encoded = encode_responses(tokenizer, prompt, [chosen, rejected], max_seq_len)
    return encoded[0], encoded[1]


def encode_responses(tokenizer: Any, prompt: str, responses: list[str], max_seq_len: int) -> list[Encoded]:
    """Each response after one shared prompt, cut as the module docstring says."""
    encoded = [encode_response_observed(tokenizer, r) for r in responses]
    fitted = [fit_response(ids, max_seq_len) for ids, _ in encoded]
    room = max_seq_len - max(len(r) for r in fitted)
    prompt_ids = cut_left(encode_prompt(tokenizer, prompt), room, getattr(tokenizer, "bos_token_id", None))
    return [
        Encoded(prompt_ids + r, len(prompt_ids), tuple(flags[: len(r)]) if any(flags) else ())
        for r, (_, flags) in zip(fitted, encoded, strict=True)
    ]


def pad_batch(sequences: list[list[int]], pad_id: int, side: str = "right") -> tuple[list[list[int]], list[list[int]]]:
    """Pad to the longest sequence; returns (ids, attention_mask)."""
    width = max(len(s) for s in sequences)
    ids, mask = [], []
    for seq in sequences:
        pad = [pad_id] * (width - len(seq))
        ones, zeros = [1] * len(seq), [0] * len(pad)
        ids.append(seq + pad if side == "right" else pad + seq)
        mask.append(ones + zeros if side == "right" else zeros + ones)
    return ids, mask
