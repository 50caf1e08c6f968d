"""The latent KV cache: per layer a pool of pages of kv_lora + rope values per position, on the backend's device.

A sequence holds the pages its page table lists (pages.py: the scheduler's bookkeeping), so the memory in use
follows the tokens held, not slots x the longest sequence, and sequences with a common prefix read the same pages.
A block gets the step's cache as [B, P, latent], gathered through the page tables (`gather`: the block graphs'
contiguous cache input, which every backend runs), or — on a backend whose blocks read pages — the pool itself
with the page tables and lengths (`paged`: graphs/blocks.PagedCache, nothing copied); either way the block's new
entries are written into their pages in place. P, the step's capacity, follows what the step's sequences need
(sizing.bucket, chosen by the scheduler so that every pipeline stage agrees).
"""

from __future__ import annotations

from typing import Iterable

import torch

from k2trt.graphs.blocks import PagedCache
from k2trt.runtime.cache.pages import PAGE_TOKENS


class PagedLatentCache:
    """Per layer one pool [pages x page_tokens, latent] of the backend's device: page q holds rows
    q * page_tokens .. (q + 1) * page_tokens - 1. Which pages a sequence holds is the scheduler's (pages.PagePool);
    a step's plan carries each of its sequences' page tables, and the step's tensors give the flat rows to read
    (`gather`) and to write (`write`). The pool grows to the highest page a plan names, an eighth more at a time,
    and keeps what it holds (pages.PagePool takes the lowest free page, so this follows the pages in use)."""

    def __init__(self, layers: Iterable[int], latent_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 page_tokens: int = PAGE_TOKENS):
        self.layers = list(layers)
        self.latent_dim, self.dtype, self.device = latent_dim, dtype, torch.device(device)
        self.page_tokens = page_tokens
        self.pages = 0
        self.tensors = {layer: self._empty(0) for layer in self.layers}
        self.step_buffer: torch.Tensor | None = None  # the gathered cache, one buffer for every layer and step
        self.peak_bytes = 0  # the most the pools held at once: a growth holds the old pools and the new ones
    def _empty(self, pages: int) -> torch.Tensor:
        # zeros, not uninitialized memory: a masked position gets probability exactly 0, and 0 * NaN would be NaN;
        # a gathered position past a sequence's pages reads row 0, whatever it holds, always finite
        return torch.zeros(max(pages, 1) * self.page_tokens, self.latent_dim, dtype=self.dtype, device=self.device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reserve(self, pages: int, limit: int | None = None) -> None:
        """Room for pages 0 .. pages - 1 in every layer, keeping what is held; grown an eighth at a time, never past
        `limit` (the pool's pages: what this rank's memory was sized for)."""
        if pages <= self.pages:
            return
        pages = max(pages, self.pages + -(-self.pages // 8))
        if limit is not None:
            pages = min(pages, max(limit, 1))
        held = self.pages * self.page_tokens  # rows of pages named before (the first pool's placeholder: none)
        before = self.bytes
        for layer, old in self.tensors.items():
            new = self._empty(pages)
            new[:held] = old[:held]
            self.tensors[layer] = new
        self.pages = pages
        self.peak_bytes = max(self.peak_bytes, before + self.bytes)  # at worst every old pool outlives the copy

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The step's cache of one layer, [B, P, latent], from its flat rows [B, P] (StepTensors.gather_rows), into
        the one step buffer: each layer's block reads it before the next layer's gather overwrites it (the same
        stream, in order), and a decode block's CUDA graph (runtime/backends/tensorrt.DecodeGraphs), which bakes in its
        cache's address, is captured once per B and P rather than at every step."""
        b, p = rows.shape
        buf = self.step_buffer
        if buf is None or buf.shape != (b, p, self.latent_dim):
            buf = self.step_buffer = torch.empty(b, p, self.latent_dim, dtype=self.dtype, device=self.device)
        torch.index_select(self.tensors[layer], 0, rows.reshape(-1), out=buf.view(b * p, self.latent_dim))
        return buf

    def paged(self, layer: int, page_table: torch.Tensor, ctx_lens: torch.Tensor, n_new: torch.Tensor) -> PagedCache:
        """The step's cache of one layer read in place, for a backend whose blocks read pages (Backend.reads_pages):
        the pool itself and the step's page tables and lengths (StepTensors), nothing copied."""
        return PagedCache(self.tensors[layer], page_table, ctx_lens, n_new, self.page_tokens)

    def write(self, layer: int, new: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Write a step's new entries in place. new [B, T, latent]; `rows` are the flat pool rows of the valid
        entries `valid` [B, T] (StepTensors.cache_rows)."""
        # every position real (decode, equal prompts): valid order is flat order, no boolean gather needed
        src = new.reshape(-1, self.latent_dim) if rows.numel() == valid.numel() else new[valid]
        self.tensors[layer].index_copy_(0, rows, src.to(self.dtype))
