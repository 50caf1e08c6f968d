"""The latent KV cache: per layer one tensor [slots, capacity, kv_lora + rope] on the backend's device.

A sequence owns one slot; its cache position j holds its token at position j. The runtime hands every block a
contiguous range of slots (a view, never a copy) and writes the block's new entries into it in place. The number
of slots and the capacity (the same for every slot) follow the sequences (`resize`, decided by the scheduler so
that every pipeline stage agrees): a step's attention spans about the positions actually written, not a configured
maximum, and memory follows the requests actually running. Slot moves (`move`, `swap`) keep the sequences of a
step contiguous when others finish.
"""

from __future__ import annotations

from typing import Iterable

import torch

from k2trt.runtime.backends.contract import CAPACITY_MULTIPLE


def bucket(needed: int, limit: int, minimum: int = CAPACITY_MULTIPLE) -> int:
    """The size to allocate for `needed`: the next power of two (at least `minimum`), at most `limit` (and never
    less than needed), so sizes change rarely (each change copies the cache) and at most double what is needed;
    always a multiple of `minimum` — a capacity capped at an odd limit is rounded up, so slot views stay 256-byte
    aligned (contract.CAPACITY_MULTIPLE)."""
    size = minimum
    while size < needed:
        size *= 2
    size = max(needed, min(size, limit))
    return -(-size // minimum) * minimum


class LatentCache:
    def __init__(self, layers: Iterable[int], latent_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.layers = list(layers)
        self.latent_dim, self.dtype, self.device = latent_dim, dtype, torch.device(device)
        self.slots = self.capacity = 0
        self.tensors = {layer: self._empty(0, 0) for layer in self.layers}

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        # zeros, not uninitialized memory: masked slots get probability exactly 0, and 0 * NaN would be NaN
        return torch.zeros(slots, capacity, self.latent_dim, dtype=self.dtype, device=self.device)

    def resize(self, slots: int, capacity: int) -> None:
        """Grow or shrink every layer to `slots` x `capacity`, keeping what fits of every kept slot."""
        if (slots, capacity) == (self.slots, self.capacity):
            return
        keep_s, keep_c = min(slots, self.slots), min(capacity, self.capacity)
        for layer, old in self.tensors.items():
            new = self._empty(slots, capacity)
            new[:keep_s, :keep_c] = old[:keep_s, :keep_c]
            self.tensors[layer] = new
        self.slots, self.capacity = slots, capacity

    def view(self, layer: int, first: int, count: int) -> torch.Tensor:
        """Slots first..first+count-1 of one layer: [count, capacity, latent], contiguous, shares memory."""
        return self.tensors[layer][first:first + count]

    def write(self, layer: int, first: int, new: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Write a step's new entries in place. new [B, T, latent]; `rows` are the flat cache rows
        (slot * capacity + position) of the valid entries `valid` [B, T] (StepTensors.cache_rows)."""
        flat = self.tensors[layer].view(-1, self.latent_dim)
        # every position real (decode, equal prompts): valid order is flat order, no boolean gather needed
        src = new.reshape(-1, self.latent_dim) if rows.numel() == valid.numel() else new[valid]
        flat.index_copy_(0, rows, src.to(self.dtype))

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors.values():
            t[dst] = t[src]

    def swap(self, a: int, b: int) -> None:
        for t in self.tensors.values():
            t[[a, b]] = t[[b, a]]
