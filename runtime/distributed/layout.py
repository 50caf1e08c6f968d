"""How P × E devices hold the model: P pipeline stages (contiguous blocks, runtime/distributed/placement.py), each
stage on E expert-parallel ranks.

Expert parallelism is DeepSeek-V3's (modeling_deepseek.py `DeepseekV3MoE`: `ep_size`, `experts_per_rank`): each of
the E ranks of a stage holds every weight of the stage's blocks — attention, router, shared expert, the dense block,
the embedding or the head — and 1/E of each MoE block's routed experts, a contiguous range of them. Attention is data
parallel: a rank runs its own requests, so it keeps the latent cache of ceil(batch / E) sequences. E must divide the
routed experts; P at most the blocks. Global rank = stage × E + expert rank, so an expert-parallel group is
contiguous and lies inside one node whenever E divides the node size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from k2trt.config import K2Config, check_expert_parallel, divisors
from k2trt.errors import K2Error
from k2trt.runtime.distributed import placement


@dataclass(frozen=True)
class Layout:
    pipeline: int  # P stages
    expert_parallel: int  # E ranks per stage

    @property
    def devices(self) -> int:
        return self.pipeline * self.expert_parallel

    @property
    def name(self) -> str:
        p, e = self.pipeline, self.expert_parallel
        return f"PP {p}" if e == 1 else f"EP {e}" if p == 1 else f"PP {p} × EP {e}"

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(stage, expert rank) of a global rank: rank = stage × E + expert rank."""
        return divmod(rank, self.expert_parallel)

    def rank_of(self, stage: int, expert_rank: int) -> int:
        return stage * self.expert_parallel + expert_rank

    def stage_ranks(self, stage: int) -> list[int]:
        """The expert-parallel group of one stage: E consecutive ranks."""
        return [self.rank_of(stage, r) for r in range(self.expert_parallel)]


def check_layout(cfg: K2Config, layout: Layout) -> None:
    """One line for a layout this model cannot take."""
    e, p = layout.expert_parallel, layout.pipeline
    if e < 1 or p < 1:
        raise K2Error(f"--pipeline and --expert-parallel must be >= 1, got {p} and {e}")
    check_expert_parallel(cfg, e)
    if p > cfg.num_hidden_layers:
        raise K2Error(f"--pipeline {p} for {cfg.num_hidden_layers} blocks: every stage needs at least one block")


def layouts_for(cfg: K2Config, devices: int) -> list[Layout]:
    """Every layout of exactly `devices`: PP only first, EP only last."""
    out = [Layout(devices // e, e) for e in divisors(devices)
           if cfg.n_routed_experts % e == 0 and devices // e <= cfg.num_hidden_layers]
    return sorted(out, key=lambda lay: lay.expert_parallel)


def rank_item(item: placement.Item, expert_parallel: int, cache_bytes: int) -> placement.Item:
    """What one expert-parallel rank holds of a block: all but the routed experts, 1/E of those, and the cache of
    its own sequences."""
    experts = item.expert_bytes // expert_parallel
    return replace(item, weight_bytes=item.weight_bytes - item.expert_bytes + experts, expert_bytes=experts,
                   cache_bytes=cache_bytes)


def rank_batch(max_batch: int, expert_parallel: int) -> int:
    """Sequences one rank of an expert-parallel group holds: attention is data parallel."""
    return math.ceil(max_batch / expert_parallel)


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    placement: placement.Placement  # the stages, sized as one rank of each holds them

    @property
    def fits(self) -> bool:
        return self.placement.fits

    @property
    def heaviest(self) -> placement.Stage:
        return self.placement.heaviest


def plan_layout(cfg: K2Config, items: list[placement.Item], layout: Layout, device_memory: int, reserve: int,
                max_context: int, max_batch: int, counts: list[int] | None = None) -> LayoutPlan:
    """The stages of `layout`: blocks split by what one rank of a stage holds (placement's min-max split)."""
    check_layout(cfg, layout)
    cache = placement.cache_bytes_per_layer(cfg, max_context, rank_batch(max_batch, layout.expert_parallel))
    per_rank = [rank_item(i, layout.expert_parallel, cache) for i in items]
    return LayoutPlan(layout, placement.place_stages(per_rank, layout.pipeline, device_memory, reserve, counts))


def smallest_pipeline(cfg: K2Config, items: list[placement.Item], expert_parallel: int, device_memory: int,
                      reserve: int, max_context: int, max_batch: int, start: int = 1) -> int | None:
    """The fewest stages >= start of `expert_parallel` ranks each that fit, or None."""
    for p in range(max(1, start), cfg.num_hidden_layers + 1):
        if plan_layout(cfg, items, Layout(p, expert_parallel), device_memory, reserve, max_context, max_batch).fits:
            return p
    return None
