"""One rank's life in a pipeline of P stages × E expert-parallel ranks: join, open only its share of the tensors (its
stage's blocks, and of their routed experts only its own range), bind them with progress, wait until every rank is
ready, then lead (rank 0: the command runs with a PipelineExecutor) or follow (every other rank)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field, replace

import torch

from k2trt.config import expert_range
from k2trt.errors import K2Error
from k2trt.graphs.weights import checkpoint_specs, global_specs, layer_prefix, layer_specs
from k2trt.runtime.backends.contract import prepare_order
from k2trt.runtime.backends.factory import BackendChoice, open_backend
from k2trt.runtime.cache.sizing import CacheBudget
from k2trt.runtime.distributed import placement
from k2trt.runtime.distributed.expert_parallel import ExchangeStats, ExpertExchange, ExpertParallelStage, ExpertShare
from k2trt.runtime.distributed.layout import Layout, check_layout, rank_item
from k2trt.runtime.distributed.pipeline import PipelineExecutor, StageRunner, Topology, follow
from k2trt.runtime.distributed.load_progress import LoadReporter, ProgressBoard, ready_key
from k2trt.runtime.distributed.world import LOAD_TIMEOUT_S, World, cpu_threads, join, new_groups
from k2trt.runtime.generation.executor import StageExecutor

UNLIMITED = 1 << 62  # no memory check on the split itself: the backend fails loudly if a stage does not fit


def stats_key(rank: int, tag: str = "end") -> str:
    return f"k2trt/stats/{tag}/{rank}"


@dataclass
class RankStats:
    backend_s: float  # inside this rank's backend calls
    transfer_s: float  # inside this rank's sends and receives within its steps (waiting for the others included)
    step_s: float  # inside its part of the steps
    exchange: ExchangeStats = field(default_factory=ExchangeStats)  # its MoE layers' all-to-alls (expert parallel)

    @property
    def busy_s(self) -> float:
        """Working, not waiting for a message."""
        return self.step_s - self.transfer_s - self.exchange.seconds

    def since(self, earlier: "RankStats") -> "RankStats":
        """The timings between two marks of one rank."""
        e, x = earlier.exchange, self.exchange
        return RankStats(self.backend_s - earlier.backend_s, self.transfer_s - earlier.transfer_s,
                         self.step_s - earlier.step_s,
                         ExchangeStats(x.seconds - e.seconds, x.bytes_sent - e.bytes_sent,
                                       x.decode_bytes - e.decode_bytes))


def transfer_share(stats: list["RankStats"]) -> float:
    """The share of rank 0's step time spent moving messages: its time in transfers less what the other ranks
    were busy with meanwhile (with one micro-batch, the stages run one after another within a step)."""
    lead = stats[0]
    pure = lead.transfer_s - sum(s.busy_s for s in stats[1:])
    return max(0.0, pure) / lead.step_s if lead.step_s else 0.0


def layout_of(world_size: int, expert_parallel: int) -> Layout:
    """P × E from the world's size and --expert-parallel E."""
    if world_size % expert_parallel:
        raise K2Error(f"{world_size} ranks cannot run --expert-parallel {expert_parallel}: the ranks are pipeline "
                      f"stages × expert-parallel ranks, so E must divide them")
    return Layout(world_size // expert_parallel, expert_parallel)


def stage_split(cfg, layout: Layout | int, counts: list[int] | None) -> placement.Placement:
    """The stages by the bytes one rank of a stage holds (the weight table's): no rank reads another stage's
    files (each tensor is checked against the same table when its own stage reads it)."""
    layout = layout if isinstance(layout, Layout) else Layout(layout, 1)
    check_layout(cfg, layout)
    items = [rank_item(i, layout.expert_parallel, 0) for i in placement.items_from_config(cfg, 0)]
    return placement.place_stages(items, layout.pipeline, UNLIMITED, 0, counts)


def stage_tensors(cfg, stage: placement.Stage, experts: tuple[int, int] | None = None) -> list[str]:
    """The full names of the checkpoint tensors a stage binds (of the routed experts only `experts`)."""
    embed, norm, head = global_specs(cfg)
    first, stop = experts or (0, cfg.n_routed_experts)

    def held(suffix: str) -> bool:
        expert = routed_expert(suffix)
        return expert is None or first <= expert < stop

    names = [embed.name] if stage.first else []
    for layer in stage.layers:
        names += [layer_prefix(layer) + s.name for s in layer_specs(cfg, layer) if held(s.name)]
    return names + ([norm.name, head.name] if stage.last else [])


def routed_expert(suffix: str) -> int | None:
    """The routed expert a layer tensor belongs to (mlp.experts.12.gate_proj.weight: 12), or None."""
    prefix = "mlp.experts."
    return int(suffix[len(prefix):].split(".", 1)[0]) if suffix.startswith(prefix) else None


@dataclass
class RankSession:
    world: World
    layout: Layout
    stage: placement.Stage
    runner: StageRunner
    leader: PipelineExecutor | None  # rank 0
    exchange: ExpertExchange | None = None  # its MoE layers' all-to-alls (expert parallel)

    def follow(self) -> None:
        follow(self.runner, self._publish)
        self._publish()

    def _stats(self) -> RankStats:
        r = self.runner
        return RankStats(r.clock.backend_s, r.transfer_s, r.step_s,
                         replace(self.exchange.stats) if self.exchange is not None else ExchangeStats())

    def mark(self, tag: str) -> list[RankStats]:
        """Rank 0, between steps: every rank's timings so far (a bench takes one run's as the difference of two
        marks)."""
        self.leader.publish(tag)
        return [self._stats()] + self._gather(tag)

    def shutdown(self) -> list[RankStats]:
        """Rank 0: end every rank's loop, then gather their timings (their own counters, through the store)."""
        self.leader.shutdown()
        return [self._stats()] + self._gather("end")

    def _gather(self, tag: str) -> list[RankStats]:
        keys = [stats_key(r, tag) for r in range(1, self.world.size)]
        self.world.wait_for(keys, self.world.timeout_s)
        return [_read_stats(self.world.store.get(k)) for k in keys]

    def _publish(self, tag: str = "end") -> None:
        self.world.store.set(stats_key(self.world.rank, tag), json.dumps(asdict(self._stats())))

    def cache_budgets(self, mine: CacheBudget) -> list[CacheBudget] | None:
        """Every rank says what its device may spend on its latent-cache pool (measured once its weights are
        bound); -> rank 0: every rank's, for the scheduler's pool to be what each can hold; others: None."""
        self.world.store.set(f"cache_budget/{self.world.rank}", mine.to_json())
        if not self.world.first:
            return None
        keys = [f"cache_budget/{r}" for r in range(self.world.size)]
        self.world.wait_for(keys, self.world.timeout_s)
        return [CacheBudget.from_json(self.world.store.get(k)) for k in keys]


def _read_stats(raw: bytes) -> RankStats:
    d = json.loads(raw)
    return RankStats(**{**d, "exchange": ExchangeStats(**d["exchange"])})


def load_rank(ckpt, choice: BackendChoice, counts: list[int] | None, timeout_s: float, expert_parallel: int = 1
              ) -> tuple[object, RankSession]:
    """Join, bind this rank's share, wait for every rank. -> (backend, session)."""
    world = join(timeout_s, use_cuda=choice.uses_cuda)
    cfg = ckpt.config
    layout = layout_of(world.size, expert_parallel)
    topology = Topology(layout, world.rank)
    plan = stage_split(cfg, layout, counts)
    stage = plan.stages[topology.stage]
    experts = expert_range(cfg, expert_parallel, topology.column) if expert_parallel > 1 else None
    tensors = stage_tensors(cfg, stage, experts)
    ckpt.check_tensors(tensors)  # this rank's share only, before any weight is bound
    groups = new_groups(world, [layout.stage_ranks(s) for s in range(layout.pipeline)]) if expert_parallel > 1 \
        else None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
    if not choice.uses_cuda:  # ranks on one machine share its cores
        torch.set_num_threads(cpu_threads(local_world))
    choice = replace(choice.for_rank(world.local_rank, cpu_threads(local_world)), expert_parallel=expert_parallel)
    weights = ExpertShare(ckpt, expert_parallel, topology.column) if expert_parallel > 1 else ckpt
    wanted = set(tensors)
    sizes = placement.load_sizes(cfg, checkpoint_specs(cfg), lambda name: name in wanted)
    order = prepare_order(stage.layers, cfg.num_hidden_layers, stage.first, stage.last)
    reporter = LoadReporter(world, [sizes[k] for k in order])
    with ProgressBoard(world) if world.first else contextlib.nullcontext():  # rank 0 shows every rank's load
        backend = open_backend(choice, weights)
        backend.prepare(stage.layers, embedding=stage.first, head=stage.last, progress=reporter)
        reporter.ready()
        world.wait_for([ready_key(r) for r in range(world.size)], LOAD_TIMEOUT_S)

    exchange = None
    if groups is None:
        def make_stage():
            return StageExecutor(backend, cfg, stage.layers, first=stage.first, last=stage.last)
    else:
        exchange = ExpertExchange(cfg, groups[topology.stage], topology.column, expert_parallel, backend.device,
                                  world.lost_contact)

        def make_stage():
            return ExpertParallelStage(backend, cfg, exchange, stage.layers, first=stage.first, last=stage.last)

    runner = StageRunner(world, topology, make_stage)
    # an expert-parallel rank's cache rows are bucketed up to what its backend takes in one call
    leader = PipelineExecutor(world, runner, backend.limits.max_batch or UNLIMITED) if world.first else None
    return backend, RankSession(world, layout, stage, runner, leader, exchange)
