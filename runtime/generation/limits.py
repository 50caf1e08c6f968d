"""The limits a scheduler works within, resolved once from the model, the user and the backend (`Limits.resolve`),
and the one error a request past the context gets (`ContextTooLong`).

One quantity runs through the runtime under four names, each bounding the next:

  max_seq      the longest sequence a TensorRT engine's optimization profiles take (`k2trt build --max-seq`),
               which the backend reports as its BackendLimits.max_context (None: no limit of its own);
  max_context  the most positions one request may hold, prompt and new tokens together: the tightest of the
               model's max_position_embeddings, the user's --max-context and the backend's (Limits.max_context);
  capacity     the positions a step's attention spans: what the step's sequences hold and write, bucketed in
               four sizes an octave, never above max_context (chosen by the scheduler, StepPlan.capacity);
  P            the cache dimension of every block graph and of the step's mask [B, T, P + T]: the capacity.

The cache's own limit is its pool: cache_pages pages of page_tokens positions (runtime/cache/pages.py), shared by
every running request; by default as many as max_batch requests at max_context hold, the most the slots could ever
need. Under expert parallelism the pool is cache_parts partitions of cache_pages pages, one per rank (each rank
holds its own sequences' latents), and each partition holds at most part_batch of the slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.backends.contract import BackendLimits
from k2trt.runtime.cache.pages import PAGE_TOKENS, pages_for
from k2trt.runtime.cache.sizing import part_slots

DEFAULT_SLOTS = 64  # sequences decoded together when neither the user nor the backend sets a limit
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per request per step, before the mask budget shrinks it
# a prefill step's mask is B x T x (P + T), P the capacity the step runs at (TensorRT's attention spans as much;
# ONNX Runtime skips the P part when no prompt has cached positions, but the mask is built that wide): chunks
# shrink so it stays under this many elements. P is what the step's own sequences hold and write.
MASK_BUDGET = 1 << 22


@dataclass(frozen=True)
class Limits:
    max_context: int  # positions one request may hold: prompt + new tokens
    max_batch: int  # sequence slots: requests running at once
    prefill_chunk: int  # prompt tokens per request per step (fewer when the mask budget asks)
    mask_budget: int = MASK_BUDGET  # elements of a prefill step's mask
    cache_pages: int = 0  # pages in the latent cache's pool, per partition (0: the default, the partition's slots
    # at max_context)
    page_tokens: int = PAGE_TOKENS  # positions per page
    cache_parts: int = 1  # partitions of the pool: one per data-parallel (expert-parallel) rank

    def __post_init__(self):
        for name in ("max_context", "max_batch", "prefill_chunk", "mask_budget", "page_tokens", "cache_parts"):
            if getattr(self, name) < 1:
                raise K2Error(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.cache_pages:
            object.__setattr__(self, "cache_pages", self.part_batch * pages_for(self.max_context, self.page_tokens))
        if self.cache_pages < self.part_batch:
            raise K2Error(f"a cache of {self.cache_pages} pages cannot give each of the {self.part_batch} slots a "
                          f"page: it needs at least {self.part_batch}")

    @property
    def part_batch(self) -> int:
        """The slots one partition of the pool holds at most (all of them with one partition)."""
        return part_slots(self.max_batch, self.cache_parts)

    @classmethod
    def resolve(cls, cfg: K2Config, backend: BackendLimits, *, max_context: int | None = None,
                max_batch: int | None = None, prefill_chunk: int | None = None,
                mask_budget: int = MASK_BUDGET, cache_pages: int | None = None, cache_parts: int = 1) -> "Limits":
        """The tightest of the model's, the user's (None: not limited) and the backend's (what a TensorRT engine
        was built for), with the defaults where nobody sets one."""
        def tightest(*values):
            return min(v for v in values if v)

        return cls(max_context=tightest(cfg.max_position_embeddings, max_context, backend.max_context),
                   max_batch=tightest(max_batch or DEFAULT_SLOTS, backend.max_batch),
                   prefill_chunk=tightest(prefill_chunk or DEFAULT_PREFILL_CHUNK, backend.max_tokens_per_step),
                   mask_budget=mask_budget, cache_pages=check_cache_pages(cache_pages, backend) or 0,
                   cache_parts=cache_parts)


def check_cache_pages(cache_pages: int | None, backend: BackendLimits) -> int | None:
    """A pool size asked for, within what the backend takes (TensorRT engines bind at most max_cache_pages; the
    default pool, the slots at max_context, always fits them)."""
    if cache_pages and backend.max_cache_pages and cache_pages > backend.max_cache_pages:
        raise K2Error(f"a cache of {cache_pages} pages exceeds the {backend.max_cache_pages} the engines take "
                      "(rebuild them with a larger --max-batch or --max-seq)")
    return cache_pages


class RequestError(K2Error):
    """A request the scheduler refuses before any work; `field` is the part of it at fault ("prompt" or
    "max_new_tokens"), for the server's 400 to name."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class ContextTooLong(RequestError):
    """The prompt and the new tokens asked for exceed max_context."""

    def __init__(self, name: str, prompt_tokens: int, new_tokens: int, max_context: int):
        super().__init__(f"{name} has {prompt_tokens} tokens; with {new_tokens} new tokens that exceeds the context "
                         f"limit of {max_context}", "prompt")
        self.prompt_tokens, self.new_tokens, self.max_context = prompt_tokens, new_tokens, max_context
