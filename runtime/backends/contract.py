"""The two contracts of the runtime: what every backend is (ONNX Runtime, TensorRT, the torch reference), and what
every backend reads its weights from. The runtime (runtime/generation/executor.py) and the tools rely on these and on nothing
else: no attribute is probed, no backend is recognised by its name.

All tensors are torch tensors on the backend's device. `latent_cache` is a slot range of the runtime's per-layer
cache [B, P, kv_lora + rope], passed in place (never copied); the runtime writes the returned `latent_new` into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import torch

from k2trt.config import K2Config

if TYPE_CHECKING:  # onnx costs a process ~0.7 s to import (ml_dtypes); a backend that runs graphs never needs it
    import onnx


class WeightSource(Protocol):
    """Where a backend's weights come from: a Checkpoint (k2trt/checkpoint.py), or seeded random weights in tests
    (k2trt/tiny/synthetic.py). Tensors come back on the CPU in their checkpoint dtypes."""

    config: K2Config

    def globals(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors outside the layers, by full name (model.embed_tokens.weight, model.norm.weight,
        lm_head.weight): only `names` when given, so a pipeline stage reads only the files it needs."""

    def block_weights(self, layer: int, experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """One layer's block-graph weight inputs (checkpoint suffixes, routed experts stacked [E, ...] by
        graphs/weights.assemble_block_weights), in graphs/weights.block_weight_specs order; with `experts` =
        (first, stop), only those routed experts (an expert-parallel rank's, config.expert_range)."""


# Cache capacities are multiples of this many positions (runtime/cache/pools.bucket), so every slot range of a
# latent cache whose per-position row is a multiple of 16 bytes (576 bf16 values for K2) starts 256-byte aligned,
# as TensorRT requires of every bound address (NvInferRuntime.h IExecutionContext::setTensorAddress). A backend
# built for a --max-seq that is not a multiple accepts the capacity rounded up (runtime/tensorrt/profiles.py).
CAPACITY_MULTIPLE = 16


def round_capacity(positions: int) -> int:
    return -(-positions // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@dataclass(frozen=True)
class BackendLimits:
    """What a backend was built for; None = no limit beyond the model's. runtime/generation/limits.Limits.resolve
    folds them into the scheduler's limits: requests outside them are refused before any work, prefill chunked
    to fit."""

    max_context: int | None = None  # most positions one sequence may hold (TensorRT: --max-seq)
    max_tokens_per_step: int | None = None  # most new positions in one call (TensorRT: --max-prefill)
    max_batch: int | None = None  # most sequences in one call (TensorRT: --max-batch)
    max_cache_pages: int | None = None  # most pages a layer's pool may hold (TensorRT: its engines' pool rows)


# progress(done, total, what): called while a backend binds weights (loading the real model takes minutes)
Progress = Callable[[int, int, str], None]


class Backend(Protocol):
    name: str  # shown in tables and summaries
    device: torch.device
    act_dtype: torch.dtype
    activation_quant: int  # the FP8 convention it computes in: graphs/fp8.WEIGHT_DEQUANT or PER_TOKEN_GROUP
    limits: BackendLimits
    weights: WeightSource

    def prepare(self, layers: Iterable[int] | None = None, *, embedding: bool = True, head: bool = True,
                progress: Progress | None = None) -> None:
        """Bind (prepare, upload) weights now, so that no step pays for it: the given layers (default: all), and
        the embedding's and head's weights unless told not to. Anything not prepared is bound on first use."""

    def session_seconds(self) -> float | None:
        """Seconds spent so far inside the inference engine's own run calls, or None where the backend cannot
        tell them from its host work (the timings then count whole backend calls)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] int64 -> hidden [B, T, d]."""

    # True: block() takes the layer's cache read in place — latent_cache a graphs/blocks.PagedCache (the pool,
    # page tables, context lengths, new counts) and mask None; the executor gathers for every other backend
    reads_pages: bool

    def block(self, layer: int, hidden: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
              mask: torch.Tensor | None, latent_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, d], rope_cos/sin [B, T, rope/2], mask [B, T, P + T] float32,
        latent_cache [B, P, latent] (or, where reads_pages, a PagedCache and no mask) -> (hidden [B, T, d],
        latent_new [B, T, latent])."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> logits [B, T, V] float32."""

    # A MoE block split at the dispatch, on a backend made for expert parallelism (expert_parallel > 1: its MoE
    # layers are bound as these parts, its weights hold one rank's routed experts): graphs/blocks.py moe_front,
    # local_experts, moe_combine; runtime/distributed/expert_parallel.py moves the rows between them.
    expert_parallel: int  # E; 1: MoE layers run whole (block)

    def moe_front(self, layer: int, hidden: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                  mask: torch.Tensor, latent_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """As block's inputs -> (residual [B, T, d], moe_input [B, T, d], topk_ids int32 [B, T, k], topk_weights
        float32 [B, T, k], shared_out [B, T, d], latent_new [B, T, latent])."""

    def moe_experts(self, layer: int, rows: torch.Tensor, expert_ids: torch.Tensor, decode: bool) -> torch.Tensor:
        """rows [R, d] dispatched to this rank, expert_ids int32 [R] (among its experts) -> expert_out [R, d], each
        row its expert's output. decode: the rows are a decode step's (TensorRT picks its profile by it)."""

    def moe_combine(self, layer: int, pair_out: torch.Tensor, topk_weights: torch.Tensor, shared_out: torch.Tensor,
                    residual: torch.Tensor) -> torch.Tensor:
        """pair_out [B·T·k, d] (every pair's expert output, back in pair order) -> hidden [B, T, d]."""

    def draft_runner(self, draft, target_embedding: torch.Tensor | None):
        """This backend's runner of an EAGLE-3 draft's pieces (runtime/backends/drafts.py) where its export or
        engines hold the draft's graphs (`k2trt export --draft`), else None: the drafter computes on the math."""
        ...

    def standalone_onnx(self, kind: str, layer: int | None) -> onnx.ModelProto | None:
        """The graph this backend runs for one block kind, with that layer's prepared weights stored in it, so
        that ONNX Runtime runs it without k2trt (polygraphy's own runners, `k2trt compare`); None where the
        backend does not run ONNX graphs on ONNX Runtime. layer is None for the embedding and the head."""


def prepare_order(layers: Iterable[int] | None, num_layers: int, embedding: bool, head: bool) -> list:
    """What Backend.prepare binds, in order: "embedding", the layer indices, "head"."""
    chosen = list(range(num_layers) if layers is None else layers)
    return (["embedding"] if embedding else []) + chosen + (["head"] if head else [])


def bound_kinds(kind: str, expert_parallel: int) -> tuple[str, ...]:
    """The graphs a layer of `kind` binds weights for: on an expert-parallel backend a MoE layer binds its front and
    its experts (the combine has no weights), else the block itself."""
    return ("moe_front", "moe_experts") if kind == "moe_block" and expert_parallel > 1 else (kind,)


def prepare_each(bind: Callable[[int | str, str], object], cfg: K2Config, layers: Iterable[int] | None,
                 embedding: bool, head: bool, progress: Progress | None) -> None:
    """Backend.prepare's loop: bind(item, kind) for each item of prepare_order (kind: the block kind of a layer,
    else the item itself), then progress(done, total, what)."""
    order = prepare_order(layers, cfg.num_hidden_layers, embedding, head)
    for i, item in enumerate(order, 1):
        bind(item, cfg.layer_kind(item) if isinstance(item, int) else item)
        if progress:
            progress(i, len(order), f"layer {item}" if isinstance(item, int) else item)


class BackendWrapper:
    """A backend that forwards every part of the contract to another: subclass it to watch or change one call
    (the compare tool's recorder, fault injection in tests)."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name, self.device, self.act_dtype = inner.name, inner.device, inner.act_dtype
        self.activation_quant, self.limits, self.weights = inner.activation_quant, inner.limits, inner.weights
        self.reads_pages = inner.reads_pages

    def prepare(self, layers=None, *, embedding: bool = True, head: bool = True, progress=None) -> None:
        self.inner.prepare(layers, embedding=embedding, head=head, progress=progress)

    def session_seconds(self) -> float | None:
        return self.inner.session_seconds()

    def embed(self, input_ids):
        return self.inner.embed(input_ids)

    def block(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        return self.inner.block(layer, hidden, rope_cos, rope_sin, mask, latent_cache)

    def head(self, hidden):
        return self.inner.head(hidden)

    @property
    def expert_parallel(self) -> int:
        return self.inner.expert_parallel

    def moe_front(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        return self.inner.moe_front(layer, hidden, rope_cos, rope_sin, mask, latent_cache)

    def moe_experts(self, layer, rows, expert_ids, decode):
        return self.inner.moe_experts(layer, rows, expert_ids, decode)

    def moe_combine(self, layer, pair_out, topk_weights, shared_out, residual):
        return self.inner.moe_combine(layer, pair_out, topk_weights, shared_out, residual)

    def draft_runner(self, draft, target_embedding):
        return self.inner.draft_runner(draft, target_embedding)

    def standalone_onnx(self, kind, layer):
        return self.inner.standalone_onnx(kind, layer)
