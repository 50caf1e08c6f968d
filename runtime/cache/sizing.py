"""How large the latent cache is: the bytes of a page on one rank, the pages a rank's memory holds, and the
bucketed sizes the step loop allocates (a step's capacity, a rank's sampler rows).

The pool is sized per rank, as vLLM's --gpu-memory-utilization is per device: `--cache-memory` (bytes, or a share of
the free memory) is what each device may spend, and a page counts only the layers that rank holds — a pipeline
stage with 1/P of the layers fits P times the pages of one process in the same memory. Each rank measures its own
device once its weights are bound (CacheBudget.measure); the scheduler's pool is what every rank can hold
(`pool_pages`: the fewest over the ranks), and under expert parallelism each rank holds one partition of it
(pages.PagePool's parts), its own sequences' pages only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

from k2trt.args import FreeShare
from k2trt.errors import K2Error
from k2trt.runtime.backends.contract import CAPACITY_MULTIPLE
from k2trt.runtime.cache.pages import PAGE_TOKENS

# The pool's default on a GPU: this share of the memory free once the model has loaded (vLLM's 0.9), at most what
# every slot at --max-context needs. On a CPU the default is the latter alone.
GPU_CACHE_SHARE = FreeShare(0.9)

CAPACITY_STEPS = 4  # a step's capacity P takes four sizes an octave (scheduler._capacity_for)


def bucket(needed: int, limit: int, minimum: int = CAPACITY_MULTIPLE, per_octave: int = 1) -> int:
    """The size to allocate for `needed`: the next of `per_octave` sizes evenly spaced in each octave above a power
    of two (per_octave 1: the next power of two; 4: 1, 1.25, 1.5, 1.75 times one), at least `minimum`, at most
    `limit` (and never less than needed), so sizes take few values (each a TensorRT shape, a CUDA graph) and
    overshoot by at most 1/per_octave; always a multiple of `minimum` — a capacity capped at an odd limit is rounded
    up, so slot views stay 256-byte aligned (contract.CAPACITY_MULTIPLE)."""
    size = minimum
    while size < needed:
        size *= 2
    step = max(minimum, size // (2 * per_octave))
    size = min(size, -(-needed // step) * step)
    size = max(needed, min(size, limit))
    return -(-size // minimum) * minimum



def grown_rows(rows: int, needed: int, limit: int) -> int:
    """Sampler rows for `needed` slots in use: kept while they hold them and are at most four times what is in
    use, else bucketed again (a power of two up to `limit`): rows change rarely, and each is a shape."""
    if rows // 4 < needed <= rows:
        return rows
    return bucket(needed, limit, minimum=1)


def page_bytes(cfg, dtype, page_tokens: int = PAGE_TOKENS, layers: int | None = None) -> int:
    """Bytes of one page over `layers` layers (default every layer): what a rank's --cache-memory is counted in."""
    import torch

    layers = cfg.num_hidden_layers if layers is None else layers
    return page_tokens * cfg.latent_dim * torch.empty(0, dtype=dtype).element_size() * layers


def free_memory(device) -> int:
    """Bytes the device has free: the GPU's (cudaMemGetInfo), or on a CPU the memory the kernel says is available
    without swapping (MemAvailable)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class CacheBudget:
    """What one rank may spend on its pool: `bytes` (None: nothing asked, the default of every slot at the
    context), the layers whose pages it holds, how it was asked (for the error), and whether it is the GPU
    default (a share capped at what every slot needs)."""
    bytes: int | None
    layers: int
    asked: str = ""
    default: bool = False
    rank: int | None = None  # a pipeline or expert-parallel rank (named in the error), None in one process

    @classmethod
    def measure(cls, spec: int | FreeShare | None, device, layers: int, rank: int | None = None) -> "CacheBudget":
        """--cache-memory on this rank's device, measured now (once its weights are bound)."""
        import torch

        default = spec is None and torch.device(device).type == "cuda"
        if default:
            spec = GPU_CACHE_SHARE
        if spec is None:
            return cls(None, layers, rank=rank)
        if isinstance(spec, FreeShare):
            free = free_memory(device)
            asked = f"{'(by default) ' if default else ''}{spec} of {free:,} free bytes"
            return cls(spec.of(free), layers, asked, default, rank)
        return cls(spec, layers, f"{spec:,} bytes", rank=rank)

    def pages(self, cfg, dtype, page_tokens: int = PAGE_TOKENS) -> int | None:
        return None if self.bytes is None else self.bytes // page_bytes(cfg, dtype, page_tokens, self.layers)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "CacheBudget":
        return cls(**json.loads(text))


def pool_pages(budgets: list[CacheBudget], cfg, dtype, slots: int, every_slot: int,
               page_tokens: int = PAGE_TOKENS) -> int | None:
    """The pages of the scheduler's pool (of each partition, under expert parallelism): the fewest any rank's
    budget holds, so every rank can hold all of them; None when no rank was given a budget (the default, every
    slot at the context). `slots` is what each partition must give a page at least; a GPU default is capped at
    `every_slot`, the pages every slot at the context needs."""
    sized = [(b, b.pages(cfg, dtype, page_tokens)) for b in budgets if b.bytes is not None]
    if not sized:
        return None
    budget, pages = min(sized, key=lambda s: s[1])
    if pages < slots:
        size = page_bytes(cfg, dtype, page_tokens, budget.layers)
        where = f" on rank {budget.rank} ({budget.layers} layers)" if budget.rank is not None else ""
        raise K2Error(f"--cache-memory {budget.asked} holds {pages} pages of {size:,} bytes{where}; "
                      f"{slots} slots need at least {slots * size:,} bytes (one page each)")
    if all(b.default for b, _ in sized):
        pages = min(pages, every_slot)
    return pages


def part_slots(max_batch: int, parts: int) -> int:
    """The slots one partition (an expert-parallel rank) may hold: its even share of max_batch."""
    return math.ceil(max_batch / parts)
