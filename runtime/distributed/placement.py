"""Which device holds what: a contiguous split of [embedding, block 0 … block L-1, head] into pipeline stages, by
exact bytes.

Each block weighs its weights and scales (from the safetensors headers, or the weight table for a preset) plus its
latent cache at the requested context and batch; the embedding counts with the first block and the final norm and
lm_head with the last, so they land on the first and the last stage. The split minimizes the heaviest stage;
among the splits that do, it takes the most even one (least sum of squared stage sizes), and among those the one
whose earlier stages are fuller. A stage must fit the device's memory less a reserve (CUDA context, TensorRT
scratch, NCCL buffers, activations); an infeasible request is refused with the smallest device count that fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from k2trt.config import K2Config
from k2trt.dtypes import torch_dtype
from k2trt.errors import K2Error
from k2trt.graphs.weights import global_specs, layer_specs, stored_bytes

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_RESERVE = 4 * 2**30
CACHE_DTYPE_BYTES = 2  # the latent cache is kept in the activation dtype: bf16 on a GPU


def parse_size(text: str, what: str = "size") -> int:
    """'140GiB', '80GB', '1.5 TB', '512' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise K2Error(f"{what} {text!r} is not a size (a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def format_gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


@dataclass(frozen=True)
class Item:
    """One block, with the embedding (first block) or the head (last block) counted in."""

    layer: int
    weight_bytes: int  # the block's own weights and scales (its routed experts included)
    extra_bytes: int  # the embedding (first block) or final norm + lm_head (last block)
    cache_bytes: int
    expert_bytes: int = 0  # the part of weight_bytes that is routed experts (an expert-parallel rank holds 1/E)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.extra_bytes + self.cache_bytes


ROUTED_EXPERTS = ".mlp.experts."  # in a tensor's name: one of a MoE layer's routed experts


def _items(per_layer: list[int], experts: list[int], embedding: int, head: int, cache_per_layer: int) -> list[Item]:
    last = len(per_layer) - 1
    return [Item(i, b, (embedding if i == 0 else 0) + (head if i == last else 0), cache_per_layer, e)
            for i, (b, e) in enumerate(zip(per_layer, experts))]


def items_from_config(cfg: K2Config, cache_per_layer: int) -> list[Item]:
    """Block sizes from the weight table (a preset)."""
    embed, norm, head = global_specs(cfg)
    kinds = {cfg.layer_kind(i): i for i in range(cfg.num_hidden_layers)}
    specs = {k: layer_specs(cfg, i) for k, i in kinds.items()}
    per_kind = {k: stored_bytes(v) for k, v in specs.items()}
    experts = {k: stored_bytes([x for x in v if x.name.startswith(ROUTED_EXPERTS[1:])]) for k, v in specs.items()}
    kinds_in_order = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    return _items([per_kind[k] for k in kinds_in_order], [experts[k] for k in kinds_in_order], stored_bytes([embed]),
                  stored_bytes([norm, head]), cache_per_layer)


def _header_bytes(h) -> int:
    n = torch_dtype(h.dtype).itemsize
    for d in h.shape:
        n *= d
    return n


def load_sizes(cfg: K2Config, header_specs: dict, only=lambda name: True) -> dict:
    """Bytes on disk of what Backend.prepare binds: "embedding", each layer index, "head" (final norm + lm_head),
    from a checkpoint's safetensors headers (name -> (dtype, shape, shard)); only the tensors `only` accepts."""
    sizes: dict = {"embedding": 0, "head": 0, **{i: 0 for i in range(cfg.num_hidden_layers)}}
    for name, h in header_specs.items():
        if not only(name):
            continue
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer < cfg.num_hidden_layers:  # multi-token-prediction layers past the last are not loaded
                sizes[layer] += _header_bytes(h)
        else:
            sizes["embedding" if name == "model.embed_tokens.weight" else "head"] += _header_bytes(h)
    return sizes


def items_from_headers(cfg: K2Config, header_specs: dict, cache_per_layer: int) -> list[Item]:
    """Block sizes from a checkpoint's headers: the bytes on disk."""
    sizes = load_sizes(cfg, header_specs)
    experts = load_sizes(cfg, header_specs, lambda name: ROUTED_EXPERTS in name)
    layers = range(cfg.num_hidden_layers)
    return _items([sizes[i] for i in layers], [experts[i] for i in layers], sizes["embedding"], sizes["head"],
                  cache_per_layer)


def cache_bytes_per_layer(cfg: K2Config, max_context: int, max_batch: int) -> int:
    return max_context * max_batch * cfg.latent_dim * CACHE_DTYPE_BYTES


@dataclass(frozen=True)
class Stage:
    index: int
    items: tuple[Item, ...]
    capacity: int  # device memory less the reserve
    first: bool  # holds the embedding
    last: bool  # holds the final norm and lm_head

    @property
    def layers(self) -> list[int]:
        return [i.layer for i in self.items]

    @property
    def weight_bytes(self) -> int:
        return sum(i.weight_bytes + i.extra_bytes for i in self.items)

    @property
    def cache_bytes(self) -> int:
        return sum(i.cache_bytes for i in self.items)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def free(self) -> int:
        return self.capacity - self.bytes

    def describe(self) -> str:
        a, b = self.layers[0], self.layers[-1]
        parts = (["embedding"] if self.first else []) + [f"{a}" if a == b else f"{a}–{b}"] \
            + (["head"] if self.last else [])
        return " + ".join(parts)


@dataclass(frozen=True)
class Placement:
    stages: tuple[Stage, ...]
    device_memory: int
    reserve: int

    @property
    def heaviest(self) -> Stage:
        return max(self.stages, key=lambda s: s.bytes)

    @property
    def fits(self) -> bool:
        return all(s.free >= 0 for s in self.stages)

    def counts(self) -> list[int]:
        return [len(s.layers) for s in self.stages]


def _split(sizes: tuple[int, ...], n: int) -> tuple[int, ...]:
    """Cut points of the min-max, then most even, then front-fullest contiguous split of sizes into n parts."""
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    total = len(sizes)

    def seg(i: int, j: int) -> int:
        return prefix[j] - prefix[i]

    @lru_cache(maxsize=None)
    def best_max(i: int, k: int) -> int:  # least possible heaviest part for items i.. in k parts
        if k == 1:
            return seg(i, total)
        return min(max(seg(i, j), best_max(j, k - 1)) for j in range(i + 1, total - k + 2))

    limit = best_max(0, n)

    @lru_cache(maxsize=None)
    def best(i: int, k: int) -> tuple:  # (sum of squares, (-size of each part, ...), cuts) under the limit
        if k == 1:
            s = seg(i, total)
            return (s * s, (-s,), ()) if s <= limit else None
        options = []
        for j in range(i + 1, total - k + 2):
            s = seg(i, j)
            if s > limit:
                break
            rest = best(j, k - 1)
            if rest is not None:
                options.append((s * s + rest[0], (-s,) + rest[1], (j,) + rest[2]))
        return min(options) if options else None

    return best(0, n)[2]


def check_stage_counts(counts: list[int] | None, devices: int, n_blocks: int) -> None:
    """The devices, and the explicit block counts per stage (--stages) if given, can split n_blocks: else one line
    (the launcher asks before any rank starts, each rank again when it places itself)."""
    if devices < 1:
        raise K2Error(f"a placement needs at least one device, got {devices}")
    if devices > n_blocks:
        raise K2Error(f"{devices} devices for {n_blocks} blocks: every stage needs at least one block")
    if counts is not None:
        if len(counts) != devices:
            raise K2Error(f"--stages gives {len(counts)} stages for {devices} devices")
        if any(c < 1 for c in counts) or sum(counts) != n_blocks:
            raise K2Error(f"--stages {','.join(map(str, counts))} must be positive block counts adding up to "
                          f"{n_blocks} (the model's blocks)")


def place_stages(items: list[Item], devices: int, device_memory: int, reserve: int = DEFAULT_RESERVE,
                counts: list[int] | None = None) -> Placement:
    """The split over `devices` stages (or the explicit block counts per stage), fitting or not: `Placement.fits`."""
    n_blocks = len(items)
    check_stage_counts(counts, devices, n_blocks)
    if counts is not None:
        cuts, at = [], 0
        for c in counts[:-1]:
            at += c
            cuts.append(at)
    else:
        cuts = list(_split(tuple(i.bytes for i in items), devices))
    bounds = [0, *cuts, n_blocks]
    capacity = device_memory - reserve
    stages = tuple(Stage(k, tuple(items[bounds[k]:bounds[k + 1]]), capacity, k == 0, k == devices - 1)
                   for k in range(devices))
    return Placement(stages, device_memory, reserve)


def parse_counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise K2Error(f"--stages {text!r} must be comma-separated block counts, e.g. 8,8,8,8,8,7,7,7") from None
