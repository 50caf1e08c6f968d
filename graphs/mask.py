"""The additive attention mask shared by every block of a step: [B, T, P + T] float32, 0 where a query may see
a key and MASK_NEG where it may not. Keys are the P cache slots followed by the T new positions."""

from __future__ import annotations

import torch

# Finite, so a fully masked row (a padding query) stays finite instead of NaN.
MASK_NEG = -1e9


def attention_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """query_pos [B, T], key_pos [B, S], key_valid [B, S] (bool) -> [B, T, S]: causal over positions."""
    allowed = key_valid.unsqueeze(1) & (key_pos.unsqueeze(1) <= query_pos.unsqueeze(2))
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(allowed, zero, torch.tensor(MASK_NEG, dtype=torch.float32))


def simple_mask(batch: int, past: int, new: int) -> torch.Tensor:
    """Every sequence has `past` valid cache slots at positions 0..past-1 and `new` new positions after them."""
    q = torch.arange(past, past + new).expand(batch, new)
    k = torch.arange(past + new).expand(batch, past + new)
    return attention_mask(q, k, torch.ones(batch, past + new, dtype=torch.bool))
