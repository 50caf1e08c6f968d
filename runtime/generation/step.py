"""One step of the model over a contiguous range of cache slots: what the scheduler decides (StepPlan, plain
integers, small enough to send to every pipeline stage) and what every block of the step shares (StepTensors,
computed from the plan wherever the step runs).

Each sequence of a step brings its own number of new tokens at its own positions: sequence b writes positions
starts[b] .. starts[b] + len(tokens[b]) - 1 of its slot. Shorter sequences are right-padded to the step's width
T; padded positions are never written to the cache, never attended to, and never sampled. So a sequence computes
the same thing whatever else shares its step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from k2trt.config import K2Config
from k2trt.graphs.mask import MASK_NEG
from k2trt.graphs.rope import rope_tables
from k2trt.runtime.cache.pages import PAGE_TOKENS, cache_rows
from k2trt.runtime.generation.sampling import SamplingParams, TokenLogprob

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Admit:
    slot: int
    sampling: SamplingParams
    grammar: object = None  # a runtime/text/grammar.Grammar the slot decodes under (one process only), or None
    resume: int | None = None  # a preempted sequence's key: its parked sampler comes back (Park)
    part: int = 0  # the pool's partition it takes its pages from: the data-parallel (expert-parallel) rank
    # holding its latents and its sampler, from admission to its end


@dataclass(frozen=True)
class Release:
    slot: int


@dataclass(frozen=True)
class Park:
    """A sequence preempted: its slot is freed, its sampler (seeded generator, grammar state) is kept under `key`
    until an Admit resumes it, so its tokens are the ones it would have sampled had it never been preempted."""
    slot: int
    key: int


@dataclass(frozen=True)
class Move:
    src: int
    dst: int


@dataclass(frozen=True)
class Swap:
    a: int
    b: int


@dataclass(frozen=True)
class Drop:
    """A parked sequence ended (cancelled while it waited to resume): its sampler goes."""
    key: int


SlotOp = Admit | Release | Park | Drop | Move | Swap


_OP_NAMES = {Admit: "admit", Release: "release", Park: "park", Drop: "drop", Move: "move", Swap: "swap"}
_OP_TYPES = {name: cls for cls, name in _OP_NAMES.items()}


def ops_to_json(ops: list[SlotOp]) -> list[dict]:
    """Slot operations as JSON values (a plan on the wire: never pickle). A grammar never travels: grammars apply
    where the scheduler samples, in one process (a pipeline's server refuses them)."""
    out = []
    for op in ops:
        d = {"op": _OP_NAMES[type(op)], **{f.name: getattr(op, f.name) for f in fields(op)}}
        if isinstance(op, Admit):
            if op.grammar is not None:
                raise ValueError("a grammar cannot be sent to another process")
            d["sampling"] = asdict(op.sampling)
        out.append(d)
    return out


def ops_from_json(values: list[dict]) -> list[SlotOp]:
    ops = []
    for d in values:
        d = dict(d)
        cls = _OP_TYPES[d.pop("op")]
        if cls is Admit:
            d["sampling"] = SamplingParams(**d["sampling"])
        ops.append(cls(**d))
    return ops


def apply_slot_ops(ops: list[SlotOp], slots: dict, admit, parked: dict | None = None) -> None:
    """What slot operations mean, on a table slot -> value that follows its sequence (a sampler, a page table):
    Admit puts `admit(op)` in its slot (not when that is None), or the value parked under its resume key; Release
    empties a slot; Park keeps its value under the key until an Admit resumes it (with `parked` None nothing is
    kept: a preempted sequence's pages are gone, and it comes back with new ones); Drop forgets a parked value;
    Move and Swap carry values between slots."""
    for op in ops:
        if isinstance(op, Admit):
            value = parked.pop(op.resume, None) if op.resume is not None and parked is not None else None
            value = admit(op) if value is None else value
            if value is not None:
                slots[op.slot] = value
        elif isinstance(op, Release):
            slots.pop(op.slot, None)
        elif isinstance(op, Park):
            value = slots.pop(op.slot, None)
            if value is not None and parked is not None:
                parked[op.key] = value
        elif isinstance(op, Drop):
            if parked is not None:
                parked.pop(op.key, None)
        elif isinstance(op, Move):
            if op.src in slots:
                slots[op.dst] = slots.pop(op.src)
        elif isinstance(op, Swap):
            a, b = slots.pop(op.a, None), slots.pop(op.b, None)
            if a is not None:
                slots[op.b] = a
            if b is not None:
                slots[op.a] = b
        else:
            raise TypeError(f"unknown slot op {op!r}")


class PageTables:
    """A rank's page tables by slot, kept from the plans it follows, so that a plan on the wire carries only what
    changed and does not grow with the context: per step sequence, how many pages at the end of the table its slot
    holds it drops and the pages it appends — [0] in most steps, since a table only grows while its sequence holds
    the slot (a new one starts empty). Rank 0 keeps one per rank it sends plans to (`changes`), the rank its own (`tables`): both follow the
    same plans, so they agree."""

    def __init__(self):
        self.by_slot: dict[int, list[int]] = {}

    def _follow(self, plan_ops: list[SlotOp]) -> None:
        apply_slot_ops(plan_ops, self.by_slot, lambda op: [])

    def changes(self, plan: "StepPlan") -> list[list[int]]:
        """Rank 0: what the plan's tables change, as [dropped, *appended] per step sequence."""
        self._follow(plan.ops)
        out = []
        for b, table in enumerate(plan.tables):
            known = self.by_slot.get(plan.first + b, [])
            if table[:len(known)] == known:  # the usual case, compared in one go: the table only grew
                kept = len(known)
            else:
                kept = 0
                while kept < min(len(known), len(table)) and known[kept] == table[kept]:
                    kept += 1
            out.append([len(known) - kept, *table[kept:]])
            self.by_slot[plan.first + b] = list(table)
        return out

    def tables(self, first: int, ops: list[SlotOp], changes: list[list[int]]) -> list[list[int]]:
        """A rank: the step sequences' whole tables, from the changes a plan carries."""
        self._follow(ops)
        out = []
        for b, (dropped, *appended) in enumerate(changes):
            known = self.by_slot.get(first + b, [])
            table = known[:len(known) - dropped] + appended
            self.by_slot[first + b] = table
            out.append(table)
        return out


@dataclass
class StepPlan:
    first: int  # the step's sequences are slots first .. first + B - 1
    tokens: list[list[int]]  # new token ids of each sequence (at least one each)
    starts: list[int]  # positions already in each sequence's cache
    sample: list[bool]  # whether to sample a token after this step (not for a prompt chunk that is not its last)
    rows: int  # sampler slots in use on the step's ranks (at least first + B)
    capacity: int  # positions the step's attention spans: the P of its mask and graphs (limits.py)
    ops: list[SlotOp] = field(default_factory=list)  # slot bookkeeping applied, in order, before the step
    tables: list[list[int]] = field(default_factory=list)  # each sequence's page table (pages.py), covering the
    # positions it holds and writes in this step
    page_tokens: int = PAGE_TOKENS  # positions per page
    pool_pages: int = 0  # pages in the whole pool (limits.cache_pages); 0: unknown (a plan made by hand)
    drafts: list[int] = field(default_factory=list)  # per sequence, the draft tokens ending its tokens, to verify
    # (speculation.py); empty: none anywhere

    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tokens), default=0)


@dataclass
class StepLogprobs:
    """The log-probabilities a step produced, by the step's sequence index b."""
    sampled: dict[int, TokenLogprob]  # of the token sampled (slots whose sampling has logprobs)
    prompt: dict[int, list[TokenLogprob | None]]  # of each prompt token of the chunk (None: the prompt's first)
    verified: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # of each token a verify row kept


def is_decode(plan: StepPlan) -> bool:
    """A decode step: every sequence feeds the one token it sampled last (past its prompt: it has cached
    positions) and samples the next. (Only the last chunk of a chunked prompt, when one token, looks the same.)"""
    return bool(plan.tokens) and all(len(t) == 1 and s > 0 for t, s in zip(plan.tokens, plan.starts)) \
        and all(plan.sample)


class RopeTable:
    """cos/sin of every position up to the largest asked for, computed once and gathered per step."""

    def __init__(self, cfg: K2Config):
        self.cfg = cfg
        self.cos = self.sin = torch.empty(0, cfg.qk_rope_head_dim // 2)

    def __call__(self, positions: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(positions)
        need = int(idx.max()) + 1 if idx.size else 0
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 64)
            self.cos, self.sin = (t[0].contiguous() for t in rope_tables(self.cfg, torch.arange(n).unsqueeze(0)))
        return torch.from_numpy(self.cos.numpy()[idx]), torch.from_numpy(self.sin.numpy()[idx])


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    rope_cos: torch.Tensor  # [B, T, rope/2]
    rope_sin: torch.Tensor
    mask: torch.Tensor  # [B, T, P + T] float32
    valid: torch.Tensor  # [B, T] bool: real (not padding) positions
    cache_rows: torch.Tensor  # flat pool rows (page * page_tokens + offset) of the valid positions, in valid order
    gather_rows: torch.Tensor  # [B, P] flat pool rows of each sequence's cache positions (row 0 past its pages)
    last: torch.Tensor  # [B] index of each sequence's last real position
    # the same cache read in place (blocks.PagedCache): page tables padded with page 0, positions already held,
    # real new positions
    page_table: torch.Tensor  # [B, max_pages] int32
    ctx_lens: torch.Tensor  # [B] int32
    n_new: torch.Tensor  # [B] int32


def step_tensors(plan: StepPlan, rope: RopeTable, device, act_dtype: torch.dtype) -> StepTensors:
    # Built in NumPy, which never starts threads: this host work runs between ONNX Runtime's sessions, and
    # torch's intra-op threads (which large tensors here would wake) would fight that pool for the cores.
    b, t, cap = plan.batch, plan.width, plan.capacity
    lengths = np.array([len(x) for x in plan.tokens], dtype=np.int64)
    starts = np.array(plan.starts, dtype=np.int64)
    ids = np.zeros((b, t), dtype=np.int64)
    for i, x in enumerate(plan.tokens):
        ids[i, :len(x)] = x
    offs = np.arange(t)
    valid = offs[None, :] < lengths[:, None]  # [B, T]
    positions = starts[:, None] + offs[None, :]  # [B, T]
    # keys: the P cache slots, then the T new positions, causal. Slot j < start is written and precedes every
    # new position of its sequence, so the cache part is one row per sequence; a new key s is seen by the new
    # positions t >= s, if it is real.
    mask = np.empty((b, t, cap + t), dtype=np.float32)
    mask[:, :, :cap] = np.where(np.arange(cap)[None, :] < starts[:, None], np.float32(0), np.float32(MASK_NEG))[:, None]
    causal = offs[None, :] <= offs[:, None]  # [T query, T key]
    mask[:, :, cap:] = np.where(causal[None] & valid[:, None, :], np.float32(0), np.float32(MASK_NEG))
    cos, sin = rope(positions)
    if len(plan.tables) != b:
        raise ValueError(f"a step of {b} sequences carries {len(plan.tables)} page tables")
    pt = plan.page_tokens
    rows = np.concatenate([cache_rows(table, positions[i, :lengths[i]], pt) for i, table in enumerate(plan.tables)])
    gather = np.zeros((b, cap), dtype=np.int64)
    tables = np.zeros((b, max([len(x) for x in plan.tables], default=0) or 1), dtype=np.int32)
    for i, table in enumerate(plan.tables):
        held = min(cap, len(table) * pt)
        gather[i, :held] = cache_rows(table, np.arange(held), pt)
        tables[i, :len(table)] = table
    as_t = torch.from_numpy
    return StepTensors(as_t(ids).to(device), cos.to(device, act_dtype), sin.to(device, act_dtype),
                       as_t(mask).to(device), as_t(valid).to(device), as_t(rows).to(device),
                       as_t(gather).to(device), as_t(lengths - 1).to(device), as_t(tables).to(device),
                       as_t(starts.astype(np.int32)).to(device), as_t(lengths.astype(np.int32)).to(device))
