"""A character tokenizer stand-in: one token per character (id = code point + 2), 0 the padding, 1 EOS.
Positions in hand-made trajectories are then counted in characters."""

from __future__ import annotations

PAD, EOS = 0, 1


class Encoding(dict):
    """What a transformers tokenizer returns: the ids by key and by attribute."""

    __getattr__ = dict.__getitem__


class Chars:
    pad_token_id, eos_token_id, bos_token_id = PAD, EOS, None

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(input_ids=self.encode(text))

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 2 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        special = {PAD: "", EOS: "" if skip_special_tokens else "</s>"}
        return "".join(special[i] if i in special else chr(i - 2) for i in ids)

    def batch_decode(self, rows, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]
