"""What a causal model is fed besides its tokens: position ids that ignore padding on either side."""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions that ignore padding on either side: 0 at each sequence's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
