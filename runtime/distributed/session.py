"""One rank's life in a pipeline: join, open only its stage's tensors, bind them with progress, wait until every
rank is ready, then lead (rank 0: the command runs with a PipelineExecutor) or follow (every other rank)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

from k2trt.graphs.weights import checkpoint_specs, global_specs, layer_prefix, layer_specs
from k2trt.runtime.backends.contract import prepare_order
from k2trt.runtime.backends.factory import BackendChoice, open_backend
from k2trt.runtime.distributed import placement
from k2trt.runtime.distributed.pipeline import PipelineExecutor, follow
from k2trt.runtime.distributed.progress import LoadReporter, ProgressBoard, ready_key
from k2trt.runtime.distributed.world import LOAD_TIMEOUT_S, World, cpu_threads, join
from k2trt.runtime.generation.executor import StageExecutor

UNLIMITED = 1 << 62  # no memory check on the split itself: the backend fails loudly if a stage does not fit


def stats_key(rank: int) -> str:
    return f"k2trt/stats/{rank}"


@dataclass
class RankStats:
    backend_s: float  # inside this rank's backend calls
    transfer_s: float  # inside this rank's sends, receives and broadcasts (waiting for the others included)
    step_s: float  # inside its part of the steps

    @property
    def busy_s(self) -> float:
        """Working, not waiting for a message."""
        return self.step_s - self.transfer_s


def transfer_share(stats: list["RankStats"]) -> float:
    """The share of rank 0's step time spent moving messages: its time in transfers less what the other ranks
    were busy with meanwhile (the stages run one after another within a step)."""
    lead = stats[0]
    pure = lead.transfer_s - sum(s.busy_s for s in stats[1:])
    return max(0.0, pure) / lead.step_s if lead.step_s else 0.0


def stage_split(cfg, size: int, counts: list[int] | None) -> placement.Placement:
    """The stages by the bytes the weight table gives: no rank reads another stage's files (each tensor is
    checked against the same table when its own stage reads it)."""
    return placement.place_stages(placement.items_from_config(cfg, 0), size, UNLIMITED, 0, counts)


def stage_tensors(cfg, stage: placement.Stage) -> list[str]:
    """The full names of the checkpoint tensors a stage binds."""
    embed, norm, head = global_specs(cfg)
    names = [embed.name] if stage.first else []
    for layer in stage.layers:
        names += [layer_prefix(layer) + s.name for s in layer_specs(cfg, layer)]
    return names + ([norm.name, head.name] if stage.last else [])


@dataclass
class RankSession:
    world: World
    stage: placement.Stage
    executor: StageExecutor
    leader: PipelineExecutor | None  # rank 0

    def follow(self) -> None:
        part = follow(self.world, self.executor)
        self._publish(RankStats(self.executor.clock.backend_s, part.transport.seconds, part.step_s))

    def shutdown(self) -> list[RankStats]:
        """Rank 0: end every rank's loop, then gather their timings (their own counters, through the store)."""
        self.leader.shutdown()
        mine = RankStats(self.executor.clock.backend_s, self.leader.transfer_seconds, self.leader.part.step_s)
        keys = [stats_key(r) for r in range(1, self.world.size)]
        self.world.wait_for(keys, self.world.timeout_s)
        return [mine] + [RankStats(**json.loads(self.world.store.get(k))) for k in keys]

    def _publish(self, stats: RankStats) -> None:
        self.world.store.set(stats_key(self.world.rank), json.dumps(stats.__dict__))


def load_rank(ckpt, choice: BackendChoice, counts: list[int] | None, timeout_s: float
              ) -> tuple[object, RankSession]:
    """Join, bind this rank's stage, wait for every rank. -> (backend, session)."""
    world = join(timeout_s, use_cuda=choice.uses_cuda)
    cfg = ckpt.config
    plan = stage_split(cfg, world.size, counts)
    stage = plan.stages[world.rank]
    ckpt.check_tensors(stage_tensors(cfg, stage))  # this stage's files only, before any weight is bound
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
    if not choice.uses_cuda:  # ranks on one machine share its cores
        torch.set_num_threads(cpu_threads(local_world))
    choice = choice.for_rank(world.local_rank, cpu_threads(local_world))
    sizes = placement.load_sizes(cfg, checkpoint_specs(cfg))
    order = prepare_order(stage.layers, cfg.num_hidden_layers, stage.first, stage.last)
    reporter = LoadReporter(world, [sizes[k] for k in order])
    with ProgressBoard(world) if world.first else contextlib.nullcontext():  # rank 0 shows every rank's load
        backend = open_backend(choice, ckpt)
        backend.prepare(stage.layers, embedding=stage.first, head=stage.last, progress=reporter)
        reporter.ready()
        world.wait_for([ready_key(r) for r in range(world.size)], LOAD_TIMEOUT_S)
    executor = StageExecutor(backend, cfg, stage.layers, first=stage.first, last=stage.last)
    leader = PipelineExecutor(world, executor) if world.first else None
    return backend, RankSession(world, stage, executor, leader)
