"""Golden data for `k2trt compare`: the torch reference generates through the runtime's own generator, and a
recording wrapper keeps what chosen blocks receive and return in the prefill step (T > 1, empty cache) and the
first decode step (T = 1, reading a non-empty cache)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from k2trt.config import BLOCK_ACTIVATIONS
from k2trt.export.block_graphs import PAGED_INPUTS
from k2trt.graphs.blocks import PagedCache
from k2trt.runtime.backends.contract import BackendWrapper
from k2trt.runtime.generation.generator import Generator


GOLDEN_STEPS = 2  # prefill + one decode step


def block_key(kind: str, layer: int | None) -> str:
    """The name a block has in the table and under --save-dir: embedding, dense_block_0, moe_block_1, head."""
    return kind if layer is None else f"{kind}_{layer}"


@dataclass
class BlockCase:
    key: str
    kind: str
    layer: int | None
    feeds: list[OrderedDict] = field(default_factory=list)  # activation inputs, one dict per step
    outputs: list[OrderedDict] = field(default_factory=list)  # the reference's outputs for those feeds


@dataclass
class Golden:
    prompts: list[list[int]]
    cases: dict[str, BlockCase]
    tokens: list[list[int]]  # the reference's greedy continuation of each prompt
    step_logits: list[np.ndarray]  # [B, V] float32 per step (last position of each sequence)


def _np(t: torch.Tensor) -> np.ndarray:
    # A copy: the generator writes into the cache it handed over right after the block returns.
    t = t.detach().cpu()
    return (t if t.dtype in (torch.int64, torch.int32) else t.float()).numpy().copy()


class Recorder(BackendWrapper):
    """A Backend that forwards to `inner` and records the chosen calls of the first `steps` steps.
    `wanted`: (kind, layer) pairs to record, layer None for the embedding and the head."""

    def __init__(self, inner, cfg, wanted: list[tuple[str, int | None]], steps: int = GOLDEN_STEPS,
                 paged: bool = False):
        super().__init__(inner)
        # its feeds are a graph's inputs: the gathered cache and its mask, or (paged: for a backend that reads
        # pages, the TensorRT engines) the pages themselves, the pool compacted to the pages the tables name
        self.reads_pages = paged
        self.cfg, self.steps = cfg, steps
        self.cases = {block_key(k, n): BlockCase(block_key(k, n), k, n) for k, n in wanted}
        self.step = -1
        self.logits: list[np.ndarray] = []

    def _keep(self, key: str, inputs: tuple, outputs: tuple) -> None:
        case = self.cases.get(key)
        if case is None or self.step >= self.steps:
            return
        names_in, names_out = BLOCK_ACTIVATIONS[case.kind]
        if isinstance(inputs[-1], PagedCache):  # (hidden, cos, sin, None, pages): the paged graphs' inputs
            names_in = [n for n in names_in if n not in ("attention_mask", "latent_cache")] + list(PAGED_INPUTS)
            inputs = (*inputs[:-2], *compact_pages(inputs[-1]))
        case.feeds.append(OrderedDict((n, _np(t)) for n, t in zip(names_in, inputs)))
        case.outputs.append(OrderedDict((n, _np(t)) for n, t in zip(names_out, outputs)))

    def embed(self, input_ids):
        self.step += 1  # one embed call per generator step
        out = self.inner.embed(input_ids)
        self._keep("embedding", (input_ids,), (out,))
        return out

    def block(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        out = self.inner.block(layer, hidden, rope_cos, rope_sin, mask, latent_cache)
        self._keep(block_key(self.cfg.layer_kind(layer), layer), (hidden, rope_cos, rope_sin, mask, latent_cache), out)
        return out

    def head(self, hidden):
        out = self.inner.head(hidden)
        self._keep("head", (hidden,), (out,))
        self.logits.append(_np(out[:, -1]))
        return out


def compact_pages(cache: PagedCache) -> tuple[torch.Tensor, ...]:
    """(pool, page_table, ctx_lens, n_new) of a PagedCache with the pool cut to the pages the tables name (in
    order of first use; a table's unused tail points at page 0), so a golden feed is the size of the context."""
    pt = cache.page_tokens
    table = cache.page_table.long().cpu()
    used = [int(p) for b in range(table.shape[0]) for p in table[b, :-(-int(cache.ctx_lens[b]) // pt)]]
    order = list(dict.fromkeys(used)) or [0]
    new_id = {p: i for i, p in enumerate(order)}
    rows = torch.cat([torch.arange(p * pt, (p + 1) * pt) for p in order])
    remapped = torch.zeros_like(table)
    for b in range(table.shape[0]):
        n = -(-int(cache.ctx_lens[b]) // pt)
        remapped[b, :n] = torch.tensor([new_id[int(p)] for p in table[b, :n]], dtype=torch.long)
    return (cache.pool.cpu()[rows], remapped.to(torch.int32), cache.ctx_lens.cpu().to(torch.int32),
            cache.n_new.cpu().to(torch.int32))


def capture(reference, cfg, prompts: list[list[int]], wanted: list[tuple[str, int | None]],
            new_tokens: int, paged: bool = False) -> Golden:
    """Greedy generation of `new_tokens` (at least GOLDEN_STEPS) through `reference`, recording `wanted` blocks
    (their attention feeds as pages with `paged`)."""
    rec = Recorder(reference, cfg, wanted, paged=paged)
    results, _ = Generator(rec, cfg).generate(prompts, max(new_tokens, GOLDEN_STEPS))
    return Golden(prompts, rec.cases, [r.token_ids[:new_tokens] for r in results], rec.logits)
