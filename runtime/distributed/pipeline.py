"""Pipeline parallelism: every rank runs a StageExecutor over its own layers; rank 0 also runs the scheduler.

One step, with S stages:
  1. rank 0 broadcasts the step plan (plain integers, as JSON bytes) to every rank: each applies its slot
     operations to its own layers' cache and derives the step's mask and rope tables itself;
  2. rank 0 embeds and runs its layers, and the hidden state [B, T, d] goes down the chain, rank r to r + 1 —
     point to point, always in the same order (NCCL ignores tags: messages match by order), never in a cycle;
  3. the last rank applies the head and samples with its per-slot samplers, and broadcasts the sampled ids;
     every rank gets them in the same collective, and rank 0's scheduler decides who stops. Its decisions reach
     the other ranks in the next plan (the slot operations), and a shutdown plan ends every rank on the same
     step.
Micro-batches in flight would number the plans and keep several between steps 1 and 3; the messages already
carry everything a stage needs, so the step fits that later.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.step import Admit, Move, Release, StepPlan, Swap
from k2trt.runtime.distributed.world import World

_OPS = {"admit": Admit, "release": Release, "move": Move, "swap": Swap}
_NAMES = {v: k for k, v in _OPS.items()}
NOT_SAMPLED = -1


# ---- plans as bytes -----------------------------------------------------------------------------------------

def encode_plan(plan: StepPlan | None) -> bytes:
    """JSON, not pickle: a rank never deserializes code from another process."""
    if plan is None:
        return b'{"shutdown": true}'
    d = asdict(plan)
    d["ops"] = [{"op": _NAMES[type(op)], **asdict(op)} for op in plan.ops]
    return json.dumps(d, separators=(",", ":")).encode()


def decode_plan(blob: bytes) -> StepPlan | None:
    d = json.loads(blob)
    if d.get("shutdown"):
        return None
    ops = []
    for o in d.pop("ops"):
        cls = _OPS[o.pop("op")]
        if cls is Admit:
            o["sampling"] = SamplingParams(**o["sampling"])
        ops.append(cls(**o))
    return StepPlan(**d, ops=ops)


class Transport:
    """The step's messages over a World's groups, with the time spent in them."""

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.seconds = 0.0

    def _timed(self, fn, *args, **kwargs):
        """A send, receive or broadcast; one that fails (gloo and NCCL raise RuntimeError) means another rank went
        away, and becomes the one line that says which and why."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            lost = e
        finally:
            self.seconds += time.perf_counter() - t0
        raise self.world.lost_contact(lost) from None

    def broadcast_plan(self, plan: StepPlan | None = None) -> StepPlan | None:
        g = self.world.cpu_group
        if self.world.first:
            blob = encode_plan(plan)
            n = torch.tensor([len(blob)], dtype=torch.int64)
            self._timed(dist.broadcast, n, 0, group=g)
            self._timed(dist.broadcast, torch.frombuffer(bytearray(blob), dtype=torch.uint8), 0, group=g)
            return plan
        n = torch.zeros(1, dtype=torch.int64)
        self._timed(dist.broadcast, n, 0, group=g)
        buf = torch.empty(int(n), dtype=torch.uint8)
        self._timed(dist.broadcast, buf, 0, group=g)
        return decode_plan(buf.numpy().tobytes())

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._timed(dist.send, hidden.contiguous(), self.world.rank + 1, group=self.world.device_group)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        h = torch.empty(shape, dtype=dtype, device=self.device)
        self._timed(dist.recv, h, self.world.rank - 1, group=self.world.device_group)
        return h

    def broadcast_ids(self, ids: list[int | None] | None, batch: int) -> list[int | None]:
        t = torch.tensor([NOT_SAMPLED if i is None else i for i in ids], dtype=torch.int64) if ids is not None \
            else torch.empty(batch, dtype=torch.int64)
        self._timed(dist.broadcast, t, self.world.size - 1, group=self.world.cpu_group)
        return [None if i == NOT_SAMPLED else int(i) for i in t.tolist()]


class PipelineStage:
    """This rank's part of every step: its StageExecutor between the messages."""

    def __init__(self, world: World, stage: StageExecutor):
        self.world, self.stage = world, stage
        self.transport = Transport(world, stage.backend.device)
        self.hidden_size = stage.cfg.hidden_size
        self.step_s = 0.0  # this rank's part of every step, from the plan's broadcast to the ids', transfers included

    def timed_step(self, plan: StepPlan | None = None) -> tuple[StepPlan | None, list[int | None]]:
        """Broadcast (rank 0) or receive the plan, then this rank's part of the step."""
        t0 = time.perf_counter()
        try:
            plan = self.transport.broadcast_plan(plan)
            return plan, ([] if plan is None else self.step(plan))
        finally:
            self.step_s += time.perf_counter() - t0

    def step(self, plan: StepPlan) -> list[int | None]:
        st_exec, tr = self.stage, self.transport
        st_exec.apply(plan)
        if not plan.tokens:
            return []
        st = st_exec.tensors(plan)
        if self.world.first:
            hidden = st_exec.embed(st)
        else:
            hidden = tr.recv_hidden((plan.batch, plan.width, self.hidden_size), st_exec.backend.act_dtype)
        hidden = st_exec.run_layers(plan, st, hidden)
        if self.world.last:
            return tr.broadcast_ids(st_exec.sample(plan, st, hidden), plan.batch)
        tr.send_hidden(hidden)
        return tr.broadcast_ids(None, plan.batch)


class PipelineExecutor:
    """Rank 0's executor: what the scheduler calls `run(plan)` on, as it would a StageExecutor."""

    def __init__(self, world: World, stage: StageExecutor):
        if not world.first:
            raise ValueError("the pipeline executor runs on rank 0")
        self.part = PipelineStage(world, stage)
        self.clock = stage.clock

    def run(self, plan: StepPlan) -> list[int | None]:
        return self.part.timed_step(plan)[1]

    def session_seconds(self) -> float | None:
        return self.part.stage.session_seconds()

    @property
    def transfer_seconds(self) -> float:
        return self.part.transport.seconds

    def shutdown(self) -> None:
        self.part.transport.broadcast_plan(None)


def follow(world: World, stage: StageExecutor) -> PipelineStage:
    """A rank other than 0: run every step rank 0 plans, until it says stop. Returns the stage (its timings)."""
    part = PipelineStage(world, stage)
    while True:
        plan, _ = part.timed_step()
        if plan is None:
            return part
