"""P pipeline stages × E expert-parallel ranks per stage: every rank runs a StageExecutor over its stage's layers;
rank 0 also runs the scheduler.

The ranks form E columns (expert rank r: ranks r, E + r, 2E + r, ...; layout.Layout numbers them) and P rows (the
stages). A column holds a share of the sequences (runtime/distributed/data_parallel.py: with E = 1, all of them):
its rank at each stage keeps their cache for the stage's layers, its last rank samples them. One step:

  1. rank 0 splits the scheduler's plan into one plan per column and sends each to the column's first rank (its
     own it keeps); every rank forwards the plan it gets to the next rank of its column, applies its slot operations
     to its own cache and derives the step's mask and rope tables itself;
  2. the first rank of a column embeds its sequences and runs its layers, and the hidden state [B, T, d] goes down
     the column, point to point; at each MoE layer the E ranks of a stage exchange (token, expert) rows among
     themselves (runtime/distributed/expert_parallel.py) — a rank with no sequence in the step takes part too;
  3. the last rank of each column samples its sequences (per-slot samplers) and sends the ids to rank 0, whose
     scheduler decides who stops; its decisions reach the ranks in a later plan (the slot operations), and a
     shutdown ends every rank.

With an EAGLE-3 draft (its aux layers named in every step message) a stage keeps the residual stream entering
each aux layer it holds, and sends those kept so far with its hidden state; the last rank of a column sends all of
them to rank 0 after its ids, where the scheduler's draft runs (on the CPU: they go over the CPU group, as bytes of
the activations' dtype).

Messages are point to point, and each goes between the same two ranks in the same order on both sides (NCCL ignores
tags: messages match by order), never in a cycle; sends are non-blocking (a blocking send waits for its receive, and
rank 0 sends the next plans while the last ranks send ids back), and every receive is posted as soon as its size is
known (a gloo send finds its receive posted, or waits for the sender's next call). So rank 0 can keep several
numbered plans in flight
— micro-batches, each with its own slots and cache on every rank (runtime/distributed/micro_batches.py) — while the
stages work on them one after another: up to P at once, each stage on a different one. Plans are JSON bytes, never
pickle.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from k2trt.runtime.distributed.layout import Layout
from k2trt.runtime.distributed.world import World
from k2trt.runtime.generation.executor import StageClock, StageExecutor, carried_aux
from k2trt.runtime.generation.interfaces import Executor
from k2trt.runtime.generation.step import (PageTables, StepLogprobs, StepPlan, is_decode, ops_from_json,
                                          ops_to_json)

NOT_SAMPLED = -1
PADDING = -2  # after the tokens a verify row kept, to the step's widest row


# ---- plans and step messages as bytes -----------------------------------------------------------------------

def _plan_dict(plan: StepPlan, tables: PageTables) -> dict:
    """JSON, not pickle: a rank never deserializes code from another process. The page tables go as what changed
    since the rank's last plan (step.PageTables), so a decode step's plan is as long at 8k positions as at 1k."""
    d = asdict(plan)
    d["ops"] = ops_to_json(plan.ops)
    d["tables"] = tables.changes(plan)
    return d


def _plan_of(d: dict, tables: PageTables) -> StepPlan:
    ops = ops_from_json(d.pop("ops"))
    d["tables"] = tables.tables(d["first"], ops, d["tables"])
    return StepPlan(**d, ops=ops)


@dataclass
class StepMessage:
    """One rank's part of a step: its column's plan, numbered by micro-batch (`lane`), whether any rank of the step
    has work (`active`: every rank of an expert-parallel stage then joins the exchanges), whether it is a decode
    step (TensorRT's profile for the experts) and the layers whose incoming residual stream the draft reads."""

    lane: int
    plan: StepPlan
    active: bool
    decode: bool
    aux: tuple[int, ...] = ()


SHUTDOWN = b'{"shutdown": true}'


@dataclass(frozen=True)
class Publish:
    """Not a step: every rank puts its timings so far in the store under `tag` (a bench's mark between runs)."""

    tag: str


def publish_message(tag: str) -> bytes:
    return json.dumps({"publish": tag}).encode()


def encode_message(m: StepMessage, tables: PageTables) -> bytes:
    """`tables`: what the receiving rank knows of its lane's page tables (kept by the sender, one per rank and lane)."""
    return json.dumps({"lane": m.lane, "active": m.active, "decode": m.decode, "aux": list(m.aux),
                       "plan": _plan_dict(m.plan, tables)}, separators=(",", ":")).encode()


def decode_message(blob: bytes, tables: dict[int, PageTables]) -> StepMessage | Publish | None:
    """`tables`: this rank's page tables, by lane."""
    d = json.loads(blob)
    if d.get("shutdown"):
        return None
    if "publish" in d:
        return Publish(d["publish"])
    return StepMessage(d["lane"], _plan_of(d["plan"], tables.setdefault(d["lane"], PageTables())), d["active"],
                       d["decode"], tuple(d["aux"]))


# ---- where this rank's messages come from and go ----------------------------------------------------------

@dataclass(frozen=True)
class Topology:
    layout: Layout
    rank: int

    @property
    def stage(self) -> int:
        return self.layout.coordinates(self.rank)[0]

    @property
    def column(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.layout.pipeline - 1

    @property
    def plan_source(self) -> int:
        """Rank 0 sends the first rank of every column its plan; the others get it from the rank before them."""
        return 0 if self.first else self.previous

    @property
    def previous(self) -> int:
        return self.layout.rank_of(self.stage - 1, self.column)

    @property
    def next(self) -> int | None:
        return None if self.last else self.layout.rank_of(self.stage + 1, self.column)

    def column_head(self, column: int) -> int:
        return self.layout.rank_of(0, column)

    def column_tail(self, column: int) -> int:
        return self.layout.rank_of(self.layout.pipeline - 1, column)


FRAME = 16 << 10  # bytes of a message's first part: a decode plan of hundreds of sequences fits


@dataclass
class Posted:
    """A receive posted before its message is sent: a gloo send to a rank that has posted nothing moves only when
    the sender next calls into gloo (measured: a plan sent while the next stage was busy waited for rank 0's next
    step), so every rank posts each receive as early as it knows its size."""

    work: object
    buffer: torch.Tensor


class Transport:
    """The step's messages over a World's groups, with the time spent in them. Sends do not wait for their
    receives (rank 0 sends the next plans while the last ranks send ids back: blocking sends would deadlock), their
    buffers held until done; receives are posted ahead (`expect_*`) and waited on, bounded by the groups' timeout.

    A message (a step's JSON) is one FRAME-byte frame — its length, then its bytes — and, past FRAME, the rest in a
    second message the receiver posts once it has read the length."""

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.seconds = 0.0
        self.pending: deque = deque()  # (work, buffer) of sends not known to be done

    def _timed(self, fn, *args, **kwargs):
        """A send, receive or wait; one that fails (gloo and NCCL raise RuntimeError) means another rank went away,
        and becomes the one line that says which and why."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            lost = e
        finally:
            self.seconds += time.perf_counter() - t0
        raise self.world.lost_contact(lost) from None

    def _send(self, t: torch.Tensor, dst: int, group) -> None:
        work = self._timed(dist.isend, t, dst, group=group)
        self.pending.append((work, t))
        while self.pending and self.pending[0][0].is_completed():
            self._timed(self.pending.popleft()[0].wait)  # raises here if the send failed

    def _post(self, buffer: torch.Tensor, src: int, group) -> Posted:
        return Posted(self._timed(dist.irecv, buffer, src, group=group), buffer)

    def wait(self, posted: Posted) -> torch.Tensor:
        self._timed(posted.work.wait, timedelta(seconds=self.world.timeout_s))
        return posted.buffer

    def flush(self) -> None:
        """Wait until every send is done (before the process group goes)."""
        timeout = timedelta(seconds=self.world.timeout_s)
        while self.pending:
            self._timed(self.pending.popleft()[0].wait, timeout)

    # ---- messages ------------------------------------------------------------------------------------------
    def send_message(self, dst: int, blob: bytes) -> None:
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        head = len(blob).to_bytes(8, "little") + blob[:FRAME - 8]
        frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._send(frame, dst, self.world.cpu_group)
        if len(blob) > FRAME - 8:
            self._send(torch.frombuffer(bytearray(blob[FRAME - 8:]), dtype=torch.uint8), dst, self.world.cpu_group)

    def expect_message(self, src: int) -> Posted:
        return self._post(torch.empty(FRAME, dtype=torch.uint8), src, self.world.cpu_group)

    def message(self, posted: Posted, src: int) -> bytes:
        frame = self.wait(posted).numpy().tobytes()
        n = int.from_bytes(frame[:8], "little")
        if n <= FRAME - 8:
            return frame[8:8 + n]
        rest = torch.empty(n - (FRAME - 8), dtype=torch.uint8)
        self._timed(dist.recv, rest, src, group=self.world.cpu_group)
        return frame[8:] + rest.numpy().tobytes()

    # ---- hidden states and sampled ids ---------------------------------------------------------------------
    def send_hidden(self, dst: int, hidden: torch.Tensor) -> None:
        """A copy goes: the send is not done when this returns, and a backend reuses its output buffers (TensorRT's
        arena) for the next step."""
        self._send(hidden.clone(memory_format=torch.contiguous_format), dst, self.world.device_group)

    def expect_hidden(self, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> Posted:
        return self._post(torch.empty(shape, dtype=dtype, device=self.device), src, self.world.device_group)

    def send_aux(self, dst: int, aux: torch.Tensor) -> None:
        """A column's aux states [B, T, A] to rank 0, whose draft runs on the CPU: over the CPU group, as the bytes
        of their dtype (a bf16 tensor is half a float32 one; p2p moves bytes)."""
        self._send(aux.detach().to("cpu").contiguous().view(-1).view(torch.uint8), dst, self.world.cpu_group)

    def expect_aux(self, src: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Posted, tuple, torch.dtype]:
        size = torch.Size(shape).numel() * dtype.itemsize
        return self._post(torch.empty(size, dtype=torch.uint8), src, self.world.cpu_group), shape, dtype

    def aux(self, expected: tuple[Posted, tuple, torch.dtype]) -> torch.Tensor:
        posted, shape, dtype = expected
        return self.wait(posted).view(dtype).reshape(shape)

    def send_ids(self, dst: int, ids: list, drafts: list[int]) -> None:
        """A column's sampled ids (at least one value travels: a column with no sequence in the step sends a
        placeholder); a verify row (drafts[b] > 0, speculation.py) sends the 1 to 1 + k tokens it kept, each row
        padded to the step's widest."""
        width = ids_width(drafts)
        values = []
        for i in ids:
            row = list(i) if isinstance(i, tuple) else [NOT_SAMPLED if i is None else i]
            values += row + [PADDING] * (width - len(row))
        self._send(torch.tensor(values or [NOT_SAMPLED], dtype=torch.int64), dst, self.world.cpu_group)

    def expect_ids(self, src: int, batch: int, drafts: list[int]) -> tuple[Posted, int, list[int]]:
        size = max(1, batch * ids_width(drafts))
        return self._post(torch.empty(size, dtype=torch.int64), src, self.world.cpu_group), batch, drafts

    def ids(self, expected: tuple[Posted, int, list[int]]) -> list:
        posted, batch, drafts = expected
        width = ids_width(drafts)
        values = self.wait(posted).tolist()[:batch * width]
        out = []
        for b in range(batch):
            row = values[b * width:(b + 1) * width]
            if b < len(drafts) and drafts[b]:
                out.append(tuple(int(v) for v in row if v != PADDING))
            else:
                out.append(None if row[0] == NOT_SAMPLED else int(row[0]))
        return out


def ids_width(drafts: list[int]) -> int:
    """Values per row of a step's ids: 1, or 1 + the most drafts a row of it verifies."""
    return 1 + max(drafts, default=0)


# ---- one rank's part of the steps ---------------------------------------------------------------------------

@dataclass
class Inbound:
    """The posted receives of a step's input on a rank past the first stage: the hidden state, then the aux states
    the stages before it kept (None without a draft, or where they hold no aux layer)."""

    hidden: Posted
    carry: Posted | None


class StageRunner:
    """This rank's stage executors — one per micro-batch (`lane`), each with its own slots, cache and samplers, all
    on the one backend and clock — and its part of each step between the messages."""

    def __init__(self, world: World, topology: Topology, make_stage):
        self.world, self.topology, self.make_stage = world, topology, make_stage
        self.lanes: dict[int, StageExecutor] = {}
        self.page_tables: dict[int, PageTables] = {}  # by lane: the tables this rank's plans build up
        first = self.stage(0)
        self.backend, self.cfg, self.clock = first.backend, first.cfg, first.clock
        self.transport = Transport(world, self.backend.device)
        self.step_s = 0.0  # inside this rank's part of the steps, its transfers included
        self.transfer_s = 0.0  # of it, inside sends and receives: both over the same windows, so busy >= 0

    def stage(self, lane: int) -> StageExecutor:
        if lane not in self.lanes:
            stage = self.make_stage()
            if self.lanes:
                stage.clock = self.clock  # one clock for the rank, whichever micro-batch it works on
            self.lanes[lane] = stage
        return self.lanes[lane]

    def session_seconds(self) -> float | None:
        return self.backend.session_seconds()

    @contextlib.contextmanager
    def timing(self):
        """A window of step work: its wall time and the transfers inside it. The transport's own counter also
        runs outside steps (a follower's flush, rank 0's shutdown); a share taken from it against step time
        could pass 1."""
        t0, moved = time.perf_counter(), self.transport.seconds
        try:
            yield
        finally:
            self.step_s += time.perf_counter() - t0
            self.transfer_s += self.transport.seconds - moved

    def step(self, m: StepMessage, blob: bytes, inbound: Inbound | None = None) -> list[int | None] | None:
        """This rank's part of one step (the message forwarded down its column first; `inbound`: the posted
        receives of its input, on a rank past the first stage); -> the sampled ids of its column's sequences on a
        last-stage rank of an active step, else None. The caller times it (`timing`)."""
        return self._step(m, blob, inbound)

    def expect_hidden(self, m: StepMessage) -> Inbound | None:
        """The receives of the step's hidden state and of the aux states carried with it, where they come (posted
        as soon as the plan is read)."""
        if self.topology.first or not m.active or not m.plan.tokens:
            return None
        plan, tr, src, d = m.plan, self.transport, self.topology.previous, self.cfg.hidden_size
        hidden = tr.expect_hidden(src, (plan.batch, plan.width, d), self.backend.act_dtype)
        carried = len(carried_aux(m.aux, self.stage(m.lane).layers[0]))
        carry = (tr.expect_hidden(src, (plan.batch, plan.width, carried * d), self.backend.act_dtype)
                 if carried else None)
        return Inbound(hidden, carry)

    def take_aux(self, m: StepMessage) -> torch.Tensor | None:
        """A last-stage rank's aux states of the step (after `step`), where the draft reads them."""
        return self.stage(m.lane).take_aux() if m.aux and m.plan.tokens else None

    def _step(self, m: StepMessage, blob: bytes, inbound: Inbound | None) -> list[int | None] | None:
        topo, tr, plan = self.topology, self.transport, m.plan
        if topo.next is not None:
            tr.send_message(topo.next, blob)
        stage = self.stage(m.lane)
        stage.aux_layers = m.aux
        stage.apply(plan)
        if not m.active:
            return None
        if not plan.tokens:  # none of this column's sequences is in the step: serve the others' experts
            if self.topology.layout.expert_parallel > 1:
                stage.run_idle(m.decode)
            return [] if topo.last else None
        st = stage.tensors(plan)
        hidden = stage.embed(st) if topo.first else tr.wait(inbound.hidden)
        carried = tr.wait(inbound.carry) if inbound is not None and inbound.carry is not None else None
        hidden = stage.run_layers(plan, st, hidden, carried)
        if topo.last:
            return stage.sample(plan, st, hidden)
        tr.send_hidden(topo.next, hidden)
        if stage.carry is not None:  # after the hidden state, as the next rank posted them
            tr.send_hidden(topo.next, stage.carry)
            stage.carry = None
        return None


class PipelineExecutor(Executor):
    """Rank 0's executor: `run(plan)` for the scheduler, as a StageExecutor's; `issue` and `complete` keep several
    numbered plans in flight (runtime/distributed/micro_batches.py)."""

    samples_here = False  # the last stage's ranks sample: no grammar or log-probabilities through a pipeline
    verifies_drafts = True  # a verify row's kept tokens come back with the ids
    captures_aux = True  # the columns' last ranks send them after their ids
    aux_layers: tuple[int, ...] = ()  # set by an EAGLE-3 scheduler: named in every step message

    def __init__(self, world: World, runner: StageRunner, max_batch: int):
        if not world.first:
            raise ValueError("the pipeline executor runs on rank 0")
        from k2trt.runtime.distributed.data_parallel import ColumnPlans

        self.world, self.runner, self.topology = world, runner, runner.topology
        self.columns = self.topology.layout.expert_parallel
        self.column_plans = lambda: ColumnPlans(self.columns, max_batch)
        self.split_by_lane: dict = {}
        self.sent_tables: dict[int, list[PageTables]] = {}  # what each column's ranks know of their page tables
        self.in_flight: deque = deque()
        self.clock: StageClock = runner.clock
        self.decode_steps = 0  # decode steps issued (bench: bytes moved per decode step)
        self.aux: torch.Tensor | None = None  # the last completed step's aux states, in the scheduler's order

    @property
    def depth(self) -> int:
        """How many steps may be in flight: one per stage."""
        return self.topology.layout.pipeline

    def issue(self, lane: int, plan: StepPlan) -> None:
        """Send every column its part of the plan and do rank 0's own."""
        with self.runner.timing():
            self._issue(lane, plan)

    def _issue(self, lane: int, plan: StepPlan) -> None:
        if self.columns == 1:
            plans = [plan]
        else:
            plans = self.split_by_lane.setdefault(lane, self.column_plans()).split(plan)
        active, decode = bool(plan.tokens), is_decode(plan)
        self.decode_steps += decode
        sent = self.sent_tables.setdefault(lane, [PageTables() for _ in range(self.columns)])
        aux = tuple(self.aux_layers)
        messages = [StepMessage(lane, p, active, decode, aux) for p in plans]
        blobs = [encode_message(m, sent[c]) for c, m in enumerate(messages)]
        tr, topo = self.runner.transport, self.topology
        # the ids' receives first (a column's last rank may send them before this rank asks), each column's aux
        # states after its ids, as its last rank sends them
        width = len(aux) * self.runner.cfg.hidden_size
        ids, auxes = [], []
        for c, p in enumerate(plans):
            remote = active and topo.column_tail(c) != 0
            ids.append(tr.expect_ids(topo.column_tail(c), p.batch, p.drafts) if remote else None)
            auxes.append(tr.expect_aux(topo.column_tail(c), (p.batch, p.width, width), self.runner.backend.act_dtype)
                         if remote and aux and p.tokens else None)
        for column in range(1, self.columns):
            tr.send_message(topo.column_head(column), blobs[column])
        own = self.runner.step(messages[0], blobs[0])
        own_aux = self.runner.take_aux(messages[0]) if topo.column_tail(0) == 0 else None
        self.in_flight.append((lane, plan, ids, own, auxes, own_aux))

    def complete(self) -> tuple[int, list[int | None]]:
        """The oldest step in flight: (its lane, the sampled id of each of its sequences); its aux states, if it
        has any, to take_aux."""
        with self.runner.timing():
            lane, plan, expected, own, auxes, own_aux = self.in_flight.popleft()
            if not plan.tokens:
                return lane, []
            tr = self.runner.transport
            ids = [own if e is None else tr.ids(e) for e in expected]
            if self.aux_layers:
                parts = [own_aux if e is None else tr.aux(e) for e in auxes]
                self.aux = parts[0] if self.columns == 1 else self._merge_rows(lane, plan, parts)
            return lane, ids[0] if self.columns == 1 else self.split_by_lane[lane].merge(plan, ids)

    def _merge_rows(self, lane: int, plan: StepPlan, parts: list[torch.Tensor | None]) -> torch.Tensor:
        """The columns' aux states [B_c, T_c, A] -> [B, T, A] in the scheduler's order (rows padded with zeros)."""
        rows = self.split_by_lane[lane].merge(plan, [list(p) if p is not None else [] for p in parts])
        out = torch.zeros(plan.batch, plan.width, rows[0].shape[-1], dtype=rows[0].dtype)
        for b, row in enumerate(rows):
            out[b, :row.shape[0]] = row
        return out

    def run(self, plan: StepPlan) -> list[int | None]:
        self.issue(0, plan)
        return self.complete()[1]

    def take_logprobs(self) -> StepLogprobs:
        return StepLogprobs({}, {})

    def take_aux(self) -> torch.Tensor | None:
        out, self.aux = self.aux, None
        return out

    def session_seconds(self) -> float | None:
        return self.runner.session_seconds()

    def shutdown(self) -> None:
        """Every column's ranks leave their loops, in order down the column."""
        self._broadcast(SHUTDOWN)
        self.runner.transport.flush()

    def publish(self, tag: str) -> None:
        """Every other rank puts its timings so far in the store under `tag`, between steps."""
        self._broadcast(publish_message(tag))

    def _broadcast(self, blob: bytes) -> None:
        """A control message to every column's head, passed down the column; the steps in flight finish first."""
        tr, topo = self.runner.transport, self.topology
        while self.in_flight:
            self.complete()
        for column in range(self.columns):
            dst = topo.next if column == 0 else topo.column_head(column)
            if dst is not None:
                tr.send_message(dst, blob)


def follow(runner: StageRunner, publish=lambda tag: None) -> StageRunner:
    """A rank other than 0: run every step rank 0 plans, until it says stop; `publish(tag)` when it asks for
    this rank's timings so far. Returns the runner (its timings)."""
    topo, tr = runner.topology, runner.transport
    posted = tr.expect_message(topo.plan_source)
    while True:
        with runner.timing():  # the wait for the plan included: a follower's idle time is time in a transfer
            blob = tr.message(posted, topo.plan_source)
        m = decode_message(blob, runner.page_tables)
        if m is None or isinstance(m, Publish):
            if topo.next is not None:
                tr.send_message(topo.next, blob)
            if m is None:
                tr.flush()
                return runner
            posted = tr.expect_message(topo.plan_source)
            publish(m.tag)
            continue
        with runner.timing():
            hidden = runner.expect_hidden(m)  # in the order they come: this step's hidden state, then the next plan
            posted = tr.expect_message(topo.plan_source)
            ids = runner.step(m, blob, hidden)
            if ids is not None:
                tr.send_ids(0, ids, m.plan.drafts)
                aux = runner.take_aux(m)
                if aux is not None:
                    tr.send_aux(0, aux)
