"""Micro-batches in flight (`--micro-batches M`): the pipeline's stages work on different steps at once.

With one batch in flight, of P stages one works while P − 1 wait. Here the requests are dealt to M lanes, each an
ordinary Scheduler (runtime/generation/scheduler.py: the same admission, chunking, stops and slot layout) over slots
and a cache of its own on every rank; the lanes plan in threads of their own, and this thread (rank 0's) drives the
pipeline: it issues a lane's numbered plan as soon as fewer than P steps are in flight, and otherwise completes the
oldest, whose ids let that lane plan its next step. So while the last stage works on lane A's step, the first
already works on lane B's. Only this thread touches the backend and the process groups; a lane only plans.

A sequence computes what it computes in any batch (its own positions, slot and seeded sampler), so the tokens are
the single process's, however the requests are dealt.

Speculation runs in each lane as in one scheduler: its verify steps go through the pipeline like any step, and an
EAGLE-3 draft gets each step's aux states with its ids (the driver takes them from the pipeline executor as it
completes the step). Each lane has a drafter of its own over one shared runner (the draft's weights once), which
the lanes call from their threads — so not a TensorRT one, whose engines only this thread may drive.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from k2trt.errors import K2Error
from k2trt.runtime.cache.sizing import part_slots
from k2trt.runtime.distributed.pipeline import PipelineExecutor
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.generation.speculation import SpecCounters
from k2trt.runtime.generation.interfaces import BatchScheduler, Executor
from k2trt.runtime.generation.step import DECODE, PREFILL, StepLogprobs, StepPlan, is_decode
from k2trt.runtime.generation.timings import Timings


class Stopped(Exception):
    """The pipeline failed: every lane stops planning."""


@dataclass
class _Submitted:
    lane: int
    plan: StepPlan
    ids: list | None = None
    aux: object = None  # the step's aux states (an EAGLE-3 draft's), in the lane's order
    done: bool = False
    issued_at: float = 0.0


class _LaneExecutor(Executor):
    """What one lane's scheduler runs its steps on: the plan goes to the driver, the ids come back."""

    samples_here = False  # the pipeline's last ranks sample
    verifies_drafts = True  # a verify row's kept tokens come back with the ids
    captures_aux = True  # the driver hands each step's aux states back with its ids

    def __init__(self, lanes: "MicroBatchScheduler", lane: int):
        self.lanes, self.lane = lanes, lane
        self.aux = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.lanes.leader.aux_layers

    @aux_layers.setter
    def aux_layers(self, layers: tuple[int, ...]) -> None:  # every lane's draft is the same draft
        self.lanes.leader.aux_layers = layers

    def run(self, plan: StepPlan) -> list[int | None]:
        item = self.lanes._submit(self.lane, plan)
        self.aux = item.aux
        return item.ids

    def take_logprobs(self) -> StepLogprobs:
        return StepLogprobs({}, {})

    def take_aux(self):
        out, self.aux = self.aux, None
        return out

    @property
    def clock(self):
        return self.lanes.leader.clock

    def session_seconds(self) -> float | None:
        return self.lanes.leader.session_seconds()


@dataclass
class _Intervals:
    """When steps of each kind were in flight, merged: a kind's wall time, however many lanes overlap."""
    spans: dict = field(default_factory=lambda: {PREFILL: [], DECODE: []})

    def add(self, kind: str, start: float, end: float) -> None:
        self.spans[kind].append((start, end))

    def seconds(self, kind: str) -> float:
        total, reach = 0.0, float("-inf")
        for a, b in sorted(self.spans[kind]):
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


class MicroBatchScheduler(BatchScheduler):
    """M lanes behind one scheduler's interface (what Generator and the server call)."""

    def __init__(self, leader: PipelineExecutor, cfg, limits, lanes: int, prefix_cache: bool = True,
                 speculation=None, drafter=None):
        self.leader, self.cfg, self.limits = leader, cfg, limits
        self.executor = leader
        if drafter is not None and drafter.runner.name == "tensorrt":
            raise K2Error("--speculative-config eagle3 with --micro-batches runs the draft in each lane's thread, "
                          "and only the pipeline's driver may use the TensorRT engines: use --micro-batches 1")
        self.drafter = drafter
        lane_batch = max(1, math.ceil(limits.max_batch / lanes))
        # each lane's cache pages are its own, on every rank: the pool is dealt out with the slots
        lane_parts = part_slots(lane_batch, limits.cache_parts)
        lane_limits = replace(limits, max_batch=lane_batch, cache_pages=max(lane_parts, limits.cache_pages // lanes))
        self.lanes = [Scheduler(_LaneExecutor(self, i), cfg, lane_limits, prefix_cache, speculation,
                                drafter.sibling() if drafter is not None else None) for i in range(lanes)]
        self._cond = threading.Condition()
        self._queue: deque[_Submitted] = deque()
        self._planning = 0  # lanes running scheduler code (not waiting for a step, not finished)
        self._error: BaseException | None = None
        self._intervals = _Intervals()

    # ---- the scheduler's interface -------------------------------------------------------------------------
    def check(self, req: Request, name: str = "the prompt") -> None:
        self.lanes[0].check(req, name)

    def submit(self, req: Request) -> Request:
        """To the lane with the fewest requests."""
        load = [len(s.waiting) + len(s.layout) for s in self.lanes]
        return self.lanes[load.index(min(load))].submit(req)

    samples_here = False  # the pipeline's last rank samples

    @property
    def spec_counters(self) -> SpecCounters:
        """The lanes' counters added up."""
        return sum((s.spec_counters for s in self.lanes), SpecCounters())

    def running(self) -> int:
        return sum(s.running() for s in self.lanes)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.lanes)

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.lanes for r in s.waiting]

    @property
    def timings(self) -> Timings:
        """The lanes' steps and tokens added up; prefill and decode time as wall time (steps of different lanes
        overlap)."""
        t = Timings()
        for s in self.lanes:
            lt = s.timings
            t.prefill_tokens += lt.prefill_tokens
            t.decode_steps += lt.decode_steps
            t.decode_tokens += lt.decode_tokens
        t.prefill_s, t.decode_s = self._intervals.seconds(PREFILL), self._intervals.seconds(DECODE)
        return t

    @timings.setter
    def timings(self, t: Timings) -> None:
        for s in self.lanes:
            s.timings = Timings()
        self._intervals = _Intervals()

    def cache_counters(self):
        return sum((s.cache_counters() for s in self.lanes[1:]), self.lanes[0].cache_counters())

    @property
    def layout(self) -> list[Request]:
        """The running requests of every lane (the server counts them)."""
        return [r for s in self.lanes for r in s.layout.order]

    def run_until_idle(self) -> None:
        """Every lane plans until its requests are done, in its thread; this thread drives the pipeline."""
        self._run_lanes([s for s in self.lanes if s.has_work()], Scheduler.run_until_idle)

    def iteration(self) -> None:
        """One iteration of every lane with work (the server's loop: new requests join between iterations); the
        lanes' steps are in flight together."""
        self._run_lanes([s for s in self.lanes if s.has_work()], Scheduler.iteration)

    def keepalive(self) -> None:
        """An empty step of every lane: each rank hears from rank 0, and pending slot operations reach it."""
        self._run_lanes(self.lanes, Scheduler.keepalive)

    def _run_lanes(self, lanes: list[Scheduler], work) -> None:
        """work(lane) for each lane, each in its own thread; this thread drives the pipeline until all are done."""
        self._error = None
        threads = [threading.Thread(target=self._lane, args=(s, work), name=f"k2trt-lane-{i}", daemon=True)
                   for i, s in enumerate(lanes)]
        with self._cond:
            self._planning = len(threads)
        for t in threads:
            t.start()
        try:
            self._drive()
        finally:
            with self._cond:
                if self._error is None and self.leader.in_flight:
                    self._error = Stopped("the pipeline stopped")
                self._cond.notify_all()
            for t in threads:
                t.join()
        if self._error is not None and not isinstance(self._error, Stopped):
            raise self._error

    # ---- the lanes' side ------------------------------------------------------------------------------------
    def _lane(self, scheduler: Scheduler, work) -> None:
        try:
            work(scheduler)
        except Stopped:  # the driver failed and raises why; the count no longer matters (each run sets it anew)
            pass
        except BaseException as e:  # noqa: BLE001 - a lane's failure stops the driver, which raises it
            with self._cond:
                self._error = self._error or e
        finally:
            with self._cond:
                self._planning -= 1
                self._cond.notify_all()

    def _submit(self, lane: int, plan: StepPlan) -> _Submitted:
        item = _Submitted(lane, plan)
        with self._cond:
            if self._error is not None:
                raise Stopped()
            self._queue.append(item)
            self._planning -= 1  # until the driver hands it the ids (and counts it planning again)
            self._cond.notify_all()
            while not item.done and self._error is None:
                self._cond.wait()
            if not item.done:
                raise Stopped()
        return item

    # ---- the driver -------------------------------------------------------------------------------------------
    def _drive(self) -> None:
        leader, flying = self.leader, {}
        while True:
            with self._cond:
                while True:
                    if self._error is not None:
                        return
                    can_issue = self._queue and len(leader.in_flight) < leader.depth
                    # complete the oldest when the pipeline is full, or when no lane is about to hand in a plan
                    must_complete = leader.in_flight and (len(leader.in_flight) >= leader.depth or
                                                          (not self._queue and self._planning == 0))
                    if can_issue or must_complete:
                        break
                    if not leader.in_flight and not self._queue and self._planning == 0:
                        return  # every lane is done
                    self._cond.wait()
                item = self._queue.popleft() if can_issue else None
            try:
                if item is not None:
                    item.issued_at = time.perf_counter()
                    leader.issue(item.lane, item.plan)
                    flying.setdefault(item.lane, deque()).append(item)
                else:
                    lane, ids = leader.complete()
                    aux = leader.take_aux()  # this step's, before the next completes
                    done = flying[lane].popleft()
                    if done.plan.tokens:
                        kind = DECODE if is_decode(done.plan) else PREFILL
                        self._intervals.add(kind, done.issued_at, time.perf_counter())
                    with self._cond:  # its lane plans again from now: wait for its next plan, not the next ids
                        done.ids, done.aux, done.done = ids, aux, True
                        self._planning += 1
                        self._cond.notify_all()
            except BaseException as e:
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                raise
