"""The latent cache's pages, as the scheduler counts them: a pool of fixed-size pages, each sequence's page table,
and the index of full pages by the tokens they hold (prefix reuse). Plain integers only: rank 0 decides, every
pipeline stage follows the page tables its plans carry (pools.PagedLatentCache holds the latents).

- A page holds `page_tokens` consecutive positions of one sequence; a sequence's page table lists its pages in
  position order, so position p lives in page table[p // page_tokens], row p % page_tokens.
- A page full of prompt tokens is published under its key: a hash chain over every token from the sequence's first
  to the page's last (the page's tokens and the key of the page before it), so two sequences share a page only when
  everything before it is the same too — the page's latents depend on all of it (vLLM's automatic prefix caching
  keys blocks the same way).
- Pages are reference counted. A shared page is read-only; a page nobody references stays in the index, evicted
  least recently used only when a new page is needed, so a page a running sequence reads is never evicted. A
  sequence gives its pages back last first, so a prefix's later pages are evicted before its earlier ones.
- Free pages are taken lowest first, so the pages in use stay at the bottom of the pool and the executors' pool
  tensors (grown to the highest page a plan names) follow the pages in use.
- Under data-parallel attention (expert-parallel ranks, each holding its own sequences' latents) the pool is
  `parts` partitions of `pages` pages, one per rank: page g is page g % pages of partition g // pages, a sequence
  takes all its pages from the partition of the rank holding it, and a rank's pool holds only its partition.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict

import numpy as np

from k2trt.errors import K2Error

PAGE_TOKENS = 64  # positions per page: where the GPU MLA kernels sit (FlashMLA's paged decode uses 64)


def page_keys(tokens: list[int], page_tokens: int = PAGE_TOKENS, parent: bytes = b"") -> list[bytes]:
    """The key of each full page of `tokens`: a hash of the page's tokens and the key of the page before it
    (`parent`: the key of the page before tokens[0], when they continue a sequence)."""
    keys = []
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        chunk = np.asarray(tokens[start:start + page_tokens], dtype=np.int64).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


def pages_for(positions: int, page_tokens: int = PAGE_TOKENS) -> int:
    return -(-positions // page_tokens)


class PagePool:
    """`pages` pages of `page_tokens` positions in each of `parts` partitions; with `prefix_cache`, full prompt pages
    are kept for reuse."""

    def __init__(self, pages: int, page_tokens: int = PAGE_TOKENS, prefix_cache: bool = True, parts: int = 1):
        if pages < 1 or page_tokens < 1 or parts < 1:
            raise K2Error(f"a page pool needs at least one page of at least one position, got {pages} × {page_tokens}")
        self.pages, self.page_tokens, self.prefix_cache, self.parts = pages, page_tokens, prefix_cache, parts
        # a heap per partition: the lowest free page first
        self.free: list[list[int]] = [list(range(q * pages, (q + 1) * pages)) for q in range(parts)]
        self.refs = [0] * (pages * parts)
        self.key_of: dict[int, bytes] = {}  # published page -> its key
        self.page_of: dict[bytes, int] = {}  # key -> published page
        # published pages nobody references, oldest first, per partition
        self.idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(parts)]

    def part_of(self, page: int) -> int:
        return page // self.pages

    # ---- what is left ------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Pages in every partition."""
        return self.pages * self.parts

    def available_in(self, part: int) -> int:
        """Pages a sequence of this partition could take now: its free ones and its published ones nobody
        references."""
        return len(self.free[part]) + len(self.idle[part])

    @property
    def available(self) -> int:
        return sum(self.available_in(q) for q in range(self.parts))

    @property
    def in_use(self) -> int:
        """Pages some sequence references."""
        return self.total - self.available

    # ---- prefixes ------------------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[int]:
        """The pages of the longest published prefix of `tokens`, referenced for the caller (release them with
        the rest of its table). At most len(tokens) - 1 positions: the last prompt token is always computed, its
        logits give the first sampled token."""
        return self.match_keys(page_keys(tokens[:max(0, len(tokens) - 1)], self.page_tokens))

    def match_keys(self, keys: list[bytes]) -> list[int]:
        """`match` for a sequence whose page keys are already known (a request keeps its own, extended as it
        grows: a prompt is hashed once, however often it waits for room)."""
        if not self.prefix_cache:
            return []
        hit: list[int] = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            hit.append(page)
        for page in hit:
            self._reference(page)
        return hit

    def publish(self, table: list[int], keys: list[bytes], full: int) -> None:
        """The first `full` pages of a sequence's table now hold the positions `keys` name (their latents written):
        other sequences may reuse them. A key already published keeps its page (two sequences prefilled the same
        prefix at once: the first wins), and the sequence publishes nothing past it: a published prefix is always
        one sequence's pages, so its latents are on the one expert-parallel rank that wrote them."""
        if not self.prefix_cache:
            return
        for page, key in zip(table[:full], keys[:full]):
            owner = self.page_of.get(key)
            if owner == page:
                continue
            if owner is not None or page in self.key_of:
                return
            self.page_of[key], self.key_of[page] = page, key

    # ---- taking and giving back ----------------------------------------------------------------------------
    def allocate(self, n: int, part: int = 0) -> list[int] | None:
        """n pages of one partition for one sequence (free ones first, then the least recently used idle ones,
        unpublished), or None, taking nothing, when fewer than n are available there."""
        if n > self.available_in(part):
            return None
        free, idle = self.free[part], self.idle[part]
        out = []
        for _ in range(n):
            if free:
                page = heapq.heappop(free)
            else:
                page, _ = idle.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def release(self, table: list[int]) -> None:
        """A sequence ends (finished, cancelled or preempted): each of its pages loses one reference; a published
        page nobody references stays reusable until evicted, any other goes back to the free list. Last page first:
        a prefix's tail becomes idle before its head, so least recently used evicts tails first."""
        for page in reversed(table):
            if self.refs[page] < 1:
                raise K2Error(f"page {page} released more often than it was taken")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.idle[self.part_of(page)][page] = None
                else:
                    heapq.heappush(self.free[self.part_of(page)], page)

    def _reference(self, page: int) -> None:
        if self.refs[page] == 0:
            self.idle[self.part_of(page)].pop(page, None)
        self.refs[page] += 1


def cache_rows(table: list[int], positions: np.ndarray, page_tokens: int = PAGE_TOKENS) -> np.ndarray:
    """The flat pool rows (page × page_tokens + offset) of a sequence's positions, through its page table."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and positions.max() >= len(table) * page_tokens:
        raise K2Error(f"position {int(positions.max())} is past the {len(table)} pages of the sequence's table")
    return np.asarray(table, dtype=np.int64)[positions // page_tokens] * page_tokens + positions % page_tokens
