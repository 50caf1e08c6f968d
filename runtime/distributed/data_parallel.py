"""Data-parallel attention under expert parallelism: which expert-parallel rank holds each sequence, and each step's
plan for every rank.

The scheduler plans one step over a contiguous range of its slots, as for one process; its page pool is E
partitions, one per rank (runtime/cache/pages.py), and each admission names the partition it took its pages from
(Admit.part, chosen by the scheduler: the least loaded; the rank holding the cached prefix it reuses; the rank it
left, when it resumes after preemption). That rank holds the sequence from its admission to its end: its latent
cache pages (at every pipeline stage of its column, numbered from 0 in the rank's own pool) and its sampler. A rank's own slots keep the scheduler's order of its
sequences, so the scheduler's contiguous range is a contiguous range on every rank, and a slot operation of the
scheduler becomes the rank's own moves (a sequence never changes rank). `ColumnPlans.split` turns a plan into one
plan per rank and `merge` puts their sampled ids back in the scheduler's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k2trt.runtime.cache.sizing import grown_rows
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.step import Admit, Drop, Move, Park, Release, SlotOp, StepPlan, Swap


@dataclass(eq=False)
class Held:
    """A sequence as the ranks see it: the rank holding it."""
    rank: int
    sampling: SamplingParams
    key: int | None = None  # set while it is parked (preempted), and on the Admit that resumes it


@dataclass
class RankSlots:
    order: list[Held | None] = field(default_factory=list)  # what each of the rank's slots holds
    rows: int = 0  # cache slots allocated on the rank


def local_ops(old: list[Held | None], new: list[Held], admitted: set) -> list[SlotOp]:
    """The rank's slot operations that turn its slots `old` into `new` (every held sequence's cache and sampler
    follow it): releases, then moves and swaps, then admissions."""
    ops: list[SlotOp] = []
    keep = set(map(id, new))
    cur = list(old) + [None] * max(0, len(new) - len(old))
    for j, h in enumerate(cur):
        # a sequence parked and resumed between two steps leaves its old slot too (its sampler parked, then back)
        if h is not None and (id(h) not in keep or h in admitted):
            ops.append(Park(j, h.key) if h.key is not None else Release(j))
            cur[j] = None
    for i, h in enumerate(new):
        if h in admitted:
            continue
        j = next(j for j, x in enumerate(cur) if x is h)
        if j != i:
            ops.append(Move(j, i) if cur[i] is None else Swap(i, j))
            cur[i], cur[j] = h, cur[i]
    ops += [Admit(i, h.sampling, resume=h.key) for i, h in enumerate(new) if h in admitted]
    return ops


class ColumnPlans:
    """The scheduler's slots mirrored onto `ranks` data-parallel ranks (one scheduler: one ColumnPlans)."""

    def __init__(self, ranks: int, max_batch: int):
        self.ranks, self.max_batch = ranks, max_batch
        self.slots: list[Held | None] = []  # the scheduler's slots
        self.per_rank = [RankSlots() for _ in range(ranks)]
        self.parked: dict[int, Held] = {}  # preempted sequences, by key
        self.drops: list[list[SlotOp]] = [[] for _ in range(ranks)]  # parked samplers to drop, per rank

    def _apply(self, ops: list[SlotOp]) -> set:
        """The scheduler's slot operations on the mirror; -> the sequences admitted."""
        admitted = set()
        for op in ops:
            if isinstance(op, Admit):
                if not 0 <= op.part < self.ranks:
                    raise ValueError(f"an admission to partition {op.part} of {self.ranks} ranks")
                h = self.parked.pop(op.resume) if op.resume is not None else Held(op.part, op.sampling)
                self._put(op.slot, h)
                admitted.add(h)
            elif isinstance(op, Release):
                admitted.discard(self.slots[op.slot])
                self.slots[op.slot] = None
            elif isinstance(op, Park):
                h = self.slots[op.slot]
                if h in admitted:  # admitted and preempted before any step: nothing of it on the ranks
                    admitted.discard(h)
                else:
                    h.key = op.key
                self.parked[op.key] = h
                self.slots[op.slot] = None
            elif isinstance(op, Drop):
                h = self.parked.pop(op.key)
                if h.key is not None:  # its rank parked a sampler
                    self.drops[h.rank].append(Drop(op.key))
            elif isinstance(op, Move):
                self._put(op.dst, self.slots[op.src])
                self.slots[op.src] = None
            elif isinstance(op, Swap):
                a, b = self.slots[op.a], self.slots[op.b]
                self._put(op.a, b)
                self._put(op.b, a)
            else:
                raise TypeError(f"unknown slot op {op!r}")
        return admitted

    def _put(self, slot: int, h: Held | None) -> None:
        self.slots += [None] * (slot + 1 - len(self.slots))
        self.slots[slot] = h

    def split(self, plan: StepPlan) -> list[StepPlan]:
        """One plan per rank: its slot operations, and its sequences of the step (a contiguous range of its
        slots, in the scheduler's order), their pages numbered in the rank's own pool (plan.pool_pages each)."""
        admitted = self._apply(plan.ops)
        step = self.slots[plan.first:plan.first + plan.batch]
        if plan.tables and not plan.pool_pages:
            raise ValueError("a plan split over data-parallel ranks must name its pool's pages per rank")
        plans = []
        for r, mine in enumerate(self.per_rank):
            new = [h for h in self.slots if h is not None and h.rank == r]
            ops = local_ops(mine.order, new, admitted) + self.drops[r]  # a Park before a Drop of the same key
            self.drops[r] = []
            mine.rows = grown_rows(mine.rows, max(1, len(new)), self.max_batch)
            mine.order = list(new)
            rows = [b for b, h in enumerate(step) if h.rank == r]
            first = new.index(step[rows[0]]) if rows else 0
            base = r * plan.pool_pages
            tables = [[page - base for page in plan.tables[b]] for b in rows] if plan.tables else []
            if any(not 0 <= page < plan.pool_pages for table in tables for page in table):
                raise ValueError(f"a sequence of rank {r} names a page outside the rank's partition")
            plans.append(StepPlan(first=first, tokens=[plan.tokens[b] for b in rows],
                                  starts=[plan.starts[b] for b in rows], sample=[plan.sample[b] for b in rows],
                                  rows=mine.rows, capacity=plan.capacity, ops=ops, tables=tables,
                                  page_tokens=plan.page_tokens, pool_pages=plan.pool_pages,
                                  drafts=[plan.drafts[b] for b in rows] if plan.drafts else []))
        for h in admitted:  # its parked sampler is back in use (every rank's ops are made)
            h.key = None
        return plans

    def merge(self, plan: StepPlan, ids_per_rank: list[list[int | None]]) -> list[int | None]:
        """The ranks' sampled ids of a split plan -> the scheduler's order."""
        step = self.slots[plan.first:plan.first + plan.batch]
        taken = [iter(ids) for ids in ids_per_rank]
        return [next(taken[h.rank]) for h in step]
