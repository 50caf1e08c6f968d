"""TensorRT optimization profiles, computed from the export manifest's symbolic shapes (no TensorRT needed).

Every graph gets two profiles, in this order (the runtime selects them by index):
  0 "prefill": T in 1..max_prefill (tuned for opt_prefill), B in 1..max_batch, P in 1..max_seq rounded up to a
     multiple of 16 (the runtime's capacity steps: contract.CAPACITY_MULTIPLE);
  1 "decode":  T = 1, the same B and P ranges — decode kernels get their own tactics.
P is the cache capacity of a graph that takes the gathered cache: P >= T always and "P+T" (the keys) is evaluated
from the P and T ranges. A graph that reads the pool in place (export/trt_form.py) has instead "pages", the width
of the page tables (1..max_seq in pages), and "rows", the layer pool's rows (up to max_batch sequences of max_seq:
the runtime's default pool, runtime/generation/limits.py, and the most BackendLimits lets it hold); its prefill
form's decompressed rows, "pages*64+T" per sequence, are activation memory TensorRT plans for the largest pages.
Weights have static shapes and need no profile entry.
The experts graph of an expert-parallel MoE block takes R rows, the (token, expert) pairs dispatched to its rank:
in decode at most every rank's B·k (the router may send them all to one rank), in prefill one call takes up to
B·T·k of them (max_rows_per_call; the runtime splits a larger dispatch into calls of that many, rows being
independent).
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import asdict, dataclass

from k2trt.errors import K2Error
from k2trt.runtime.backends.contract import round_capacity
from k2trt.runtime.aot.mla import PAGE_TOKENS  # the cache's (runtime/cache/pages.py; a test holds them equal)

PROFILE_NAMES = ("prefill", "decode")


def pages_for(positions: int) -> int:
    """Pages of PAGE_TOKENS positions that hold `positions`."""
    return -(-positions // PAGE_TOKENS)
PREFILL, DECODE = 0, 1  # profile indices, in engine order


class ProfileError(K2Error, ValueError):
    """Profile flags that contradict each other, or a manifest shape they cannot evaluate."""


@dataclass(frozen=True)
class ProfileSpec:
    max_batch: int = 8
    max_seq: int = 4096  # cache capacity, i.e. the most positions a sequence may have
    max_prefill: int = 2048  # the most new positions in one call
    opt_batch: int = 1
    opt_prefill: int = 512
    opt_seq: int = 1024

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProfileError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.max_prefill > self.max_seq:
            raise ProfileError(f"--max-prefill {self.max_prefill} exceeds --max-seq {self.max_seq} "
                               "(a prefill cannot hold more positions than the cache)")
        for opt, mx in (("opt_batch", "max_batch"), ("opt_prefill", "max_prefill"), ("opt_seq", "max_seq")):
            if getattr(self, opt) > getattr(self, mx):
                raise ProfileError(f"--{opt.replace('_', '-')} {getattr(self, opt)} exceeds "
                                   f"--{mx.replace('_', '-')} {getattr(self, mx)}")

    # (min, opt, max) of each named dim per profile
    def dim_ranges(self, profile: str, dispatch: dict | None = None) -> dict[str, tuple[int, int, int]]:
        """dispatch: {"top_k": k, "ranks": E} of an experts graph (its R rows)."""
        if profile not in PROFILE_NAMES:
            raise ProfileError(f"unknown profile {profile!r}; expected one of {PROFILE_NAMES}")
        t = (1, self.opt_prefill, self.max_prefill) if profile == "prefill" else (1, 1, 1)
        pages = (1, pages_for(self.opt_seq), pages_for(self.max_capacity))
        dims = {"B": (1, self.opt_batch, self.max_batch), "T": t, "P": (1, self.opt_seq, self.max_capacity),
                "pages": pages, "rows": (PAGE_TOKENS, self.opt_batch * pages[1] * PAGE_TOKENS,
                                         self.pool_pages * PAGE_TOKENS)}
        if dispatch is not None:
            dims["R"] = self.row_range(profile, dispatch["top_k"], dispatch["ranks"])
        return dims

    def row_range(self, profile: str, top_k: int, ranks: int) -> tuple[int, int, int]:
        """(min, opt, max) rows of one experts call: decode, every rank's batch on this one; prefill, one rank's
        worth of a prefill call (at least the decode range)."""
        decode = (1, self.opt_batch * top_k, self.max_batch * top_k * ranks)
        if profile == "decode":
            return decode
        return (1, self.opt_batch * self.opt_prefill * top_k,
                max(decode[2], self.max_batch * self.max_prefill * top_k))

    @property
    def max_capacity(self) -> int:
        """The largest cache capacity P a call may have: --max-seq rounded up to whole capacity steps (the runtime's
        capacities are multiples of contract.CAPACITY_MULTIPLE, so cache slot views stay 256-byte aligned)."""
        return round_capacity(self.max_seq)

    @property
    def pool_pages(self) -> int:
        """The most pages a layer's pool may hold: max_batch sequences at max_seq."""
        return self.max_batch * pages_for(self.max_capacity)

    def as_dict(self) -> dict:
        return asdict(self)


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    d = ProfileSpec()
    p.add_argument("--max-batch", type=int, default=d.max_batch, help=f"largest batch (default {d.max_batch})")
    p.add_argument("--max-seq", type=int, default=d.max_seq,
                   help=f"cache capacity: most positions per sequence (default {d.max_seq})")
    p.add_argument("--max-prefill", type=int, default=d.max_prefill,
                   help=f"most new positions in one prefill call (default {d.max_prefill})")
    p.add_argument("--opt-batch", type=int, default=d.opt_batch, help=f"batch to tune for (default {d.opt_batch})")
    p.add_argument("--opt-prefill", type=int, default=d.opt_prefill,
                   help=f"prefill length to tune for (default {d.opt_prefill})")
    p.add_argument("--opt-seq", type=int, default=d.opt_seq,
                   help=f"cache capacity to tune for (default {d.opt_seq})")


def spec_from_args(args) -> ProfileSpec:
    return ProfileSpec(max_batch=args.max_batch, max_seq=args.max_seq, max_prefill=args.max_prefill,
                       opt_batch=args.opt_batch, opt_prefill=args.opt_prefill, opt_seq=args.opt_seq)


# ---- symbolic dims ----------------------------------------------------------------------------------

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def eval_dim(dim, values: dict[str, int]) -> int:
    """An int, or an expression over named dims with + - * and integers ("P+T"), for the given values."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim
    if not isinstance(dim, str):
        raise ProfileError(f"shape entry {dim!r} is neither an int nor a dim expression")
    try:
        tree = ast.parse(dim, mode="eval").body
    except SyntaxError:
        raise ProfileError(f"cannot parse dim expression {dim!r}") from None

    def ev(node) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in values:
                raise ProfileError(f"dim expression {dim!r} names {node.id!r}; known dims: {', '.join(values)}")
            return values[node.id]
        raise ProfileError(f"dim expression {dim!r}: only + - * over dims and integers are allowed")

    return ev(tree)


def is_dynamic(shape: list) -> bool:
    return any(not isinstance(d, int) for d in shape)


@dataclass(frozen=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, ShapeRange]  # dynamic non-weight input name -> range

    def as_dict(self) -> dict:
        return {"name": self.name, "shapes": {k: v.as_dict() for k, v in self.shapes.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(d["name"], {k: ShapeRange(tuple(v["min"]), tuple(v["opt"]), tuple(v["max"]))
                               for k, v in d["shapes"].items()})


def graph_profiles(spec: ProfileSpec, graph: dict) -> list[Profile]:
    """The prefill and decode profiles of one manifest graph entry (its "inputs" and "weights")."""
    weights = set(graph.get("weights", ()))
    profiles = []
    for name in PROFILE_NAMES:
        ranges = spec.dim_ranges(name, graph.get("dispatch"))
        corners = [{d: r[i] for d, r in ranges.items()} for i in range(3)]  # min, opt, max values
        shapes = {}
        for inp in graph["inputs"]:
            if inp["name"] in weights:
                if is_dynamic(inp["shape"]):
                    raise ProfileError(f"weight input {inp['name']!r} has a dynamic shape {inp['shape']}")
                continue
            if not is_dynamic(inp["shape"]):
                continue
            mn, opt, mx = (tuple(eval_dim(d, c) for d in inp["shape"]) for c in corners)
            shapes[inp["name"]] = ShapeRange(mn, opt, mx)
        profiles.append(Profile(name, shapes))
    return profiles


def profile_index(t: int) -> int:
    """The profile a call with T new positions runs under."""
    return DECODE if t == 1 else PREFILL


def check_table_pages(spec: ProfileSpec, pages: int) -> None:
    """Refuse page tables wider than the engines' "pages" range."""
    most = pages_for(spec.max_capacity)
    if not 1 <= pages <= most:
        raise K2Error(f"page tables of {pages} pages are outside the engines' range 1..{most} (--max-seq "
                      f"{spec.max_seq}); rebuild with a larger --max-seq or shorten the request")


def check_call_shape(spec: ProfileSpec, batch: int, t: int, capacity: int | None = None) -> None:
    """Refuse, before any GPU work, a call the engines were not built for (capacity: a gathered cache's P, for a
    graph that takes one; the paged engines' tables are check_table_pages')."""
    if not 1 <= batch <= spec.max_batch:
        raise K2Error(f"batch {batch} is outside the engines' range 1..{spec.max_batch} (rebuild with --max-batch)")
    if not 1 <= t <= spec.max_prefill:
        raise K2Error(f"{t} new positions exceed the engines' --max-prefill {spec.max_prefill}")
    if capacity is not None and not 1 <= capacity <= spec.max_capacity:
        raise K2Error(f"cache capacity {capacity} exceeds the engines' --max-seq {spec.max_seq} "
                      "(rebuild with a larger --max-seq or shorten the request)")
