"""Small model wrappers shared by tests of different folders."""

from __future__ import annotations

import torch


class DoubledLogits(torch.nn.Module):
    """A causal LM behind a module of no known structure, its logits doubled: the same argmax, a different
    softmax (tests/models/test_token_logprobs.py: a model the fast path does not know; tests/stages/
    test_evaluate.py: a sharper model than its inner one)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 2
        return out
