"""A roofline estimate of one decode step of a layout: the bytes each device reads from its memory and the bytes
each sends over its links, divided by their bandwidths. Decode is memory-bound (an expert needs ~200 tokens before
its FP8 GEMM is compute-bound on an H200), so bytes, not FLOPs, set the floor; latencies of messages and kernel
launches are left out, so real steps are slower — the estimate ranks layouts, it does not promise a speed.

Per decode step, with B sequences decoding and every one at the full context (the worst case):
- every rank reads all of its blocks' weights but the routed experts, its sequences' latent cache, and of each MoE
  block the experts the step's B tokens route to: with top-k of N experts, an expert is chosen by one token with
  probability k/N, so by at least one of B tokens with 1 − (1 − k/N)^B (routing taken as uniform);
- an expert-parallel rank sends each of its tokens' k choices to the experts' ranks and gets the results back:
  2 · ceil(B/E) · k · d · 2 bytes per MoE block, (E − 1)/E of it to other ranks (DeepEP's dispatch and combine);
- a pipeline hop carries each rank's hidden states, ceil(B/E) · d · 2 bytes, to the same rank of the next stage.
Transfers inside a node go over NVLink; a transfer between nodes over the network. Messages also cost latency: a
MoE block's dispatch and combine take at least what DeepEP's low-latency kernels measured for that EP size (its
V1 table, docs/legacy.md: H800, CX7 400 Gb/s, 128 tokens — 77 + 114 µs at EP 8 up to 194 + 360 µs at EP 256), and a
pipeline hop HOP_LATENCY_S. The stages of one step run one after another, so the step is the sum of the stages and
the hops. Kernel launches and overlap are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.config import K2Config
from k2trt.runtime.distributed.layout import LayoutPlan, rank_batch

ACT_BYTES = 2  # hidden states and expert activations cross links in bf16

# Defaults, each from its source (stated in `k2trt plan --help`)
H200_HBM = 4.8e12  # bytes/s: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM, HBM3e)
H200_NVLINK = 450e9  # bytes/s one way: the datasheet's 900 GB/s NVLink is both directions together
NETWORK = 50e9  # bytes/s one way per GPU: a 400 Gb/s InfiniBand NDR adapter per GPU (ConnectX-7, as in DGX H200)
NODE_SIZE = 8  # GPUs per node (HGX H200)
# DeepEP's low-latency dispatch + combine per EP size (docs/legacy.md, "Low-latency kernels with pure RDMA"), seconds
DEEPEP_LOW_LATENCY_S = {8: 191e-6, 16: 313e-6, 32: 428e-6, 64: 487e-6, 128: 561e-6, 256: 554e-6}
HOP_LATENCY_S = 15e-6  # one point-to-point send of a pipeline hop (NCCL on NVLink or InfiniBand: 10–20 µs)


def all_to_all_latency(expert_parallel: int) -> float:
    """A MoE block's dispatch + combine at the least: DeepEP's figure for the nearest EP size at or above (EP 8's
    below 8: its kernels do not go faster for fewer ranks; 0 without expert parallelism)."""
    if expert_parallel == 1:
        return 0.0
    sizes = sorted(DEEPEP_LOW_LATENCY_S)
    return DEEPEP_LOW_LATENCY_S[next((s for s in sizes if s >= expert_parallel), sizes[-1])]


@dataclass(frozen=True)
class Links:
    hbm: float = H200_HBM
    nvlink: float = H200_NVLINK
    network: float = NETWORK
    node_size: int = NODE_SIZE
    all_to_all_latency: float | None = None  # per MoE block; None: DeepEP's figure for the EP size
    hop_latency: float = HOP_LATENCY_S

    def between(self, rank_a: int, rank_b: int) -> float:
        return self.nvlink if rank_a // self.node_size == rank_b // self.node_size else self.network


@dataclass(frozen=True)
class StageCost:
    stage: int
    read_bytes: int  # per rank
    all_to_all_bytes: int  # per rank, to other ranks of its expert-parallel group
    read_s: float
    all_to_all_s: float
    hop_bytes: int  # per rank, to the next stage (0 for the last)
    hop_s: float

    @property
    def seconds(self) -> float:
        return self.read_s + self.all_to_all_s + self.hop_s


@dataclass(frozen=True)
class StepEstimate:
    stages: tuple[StageCost, ...]
    batch: int

    @property
    def step_s(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def read_bytes(self) -> int:
        """Per rank of the busiest stage."""
        return max(s.read_bytes for s in self.stages)

    @property
    def link_bytes(self) -> int:
        """Per rank of the stage that sends the most."""
        return max(s.all_to_all_bytes + s.hop_bytes for s in self.stages)

    @property
    def all_to_all_share(self) -> float:
        return sum(s.all_to_all_s for s in self.stages) / self.step_s


def experts_hit(cfg: K2Config, tokens: int) -> float:
    """Expected share of a MoE block's routed experts that `tokens` tokens route to (uniform routing)."""
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens


def decode_step(cfg: K2Config, plan: LayoutPlan, batch: int, links: Links = Links()) -> StepEstimate:
    e = plan.layout.expert_parallel
    mine = rank_batch(batch, e)  # sequences per rank (attention is data parallel)
    hit = experts_hit(cfg, batch)  # every rank's experts serve the tokens of the whole group
    d = cfg.hidden_size
    stages = []
    floor = all_to_all_latency(e) if links.all_to_all_latency is None else links.all_to_all_latency
    for stage in plan.placement.stages:
        read = dispatch = moe = 0
        for item in stage.items:
            read += item.weight_bytes - item.expert_bytes + round(item.expert_bytes * hit) + item.cache_bytes
            if cfg.is_moe_layer(item.layer) and e > 1:
                dispatch += 2 * mine * cfg.num_experts_per_tok * d * ACT_BYTES * (e - 1) // e
                moe += 1
        if stage.first:  # the embedding: one row per token, not the table
            read += mine * d * ACT_BYTES
        if stage.last:  # the final norm and lm_head: all of it
            read += stage.items[-1].extra_bytes
        group = range(stage.index * e, stage.index * e + e)
        a2a_bw = min(links.between(group[0], r) for r in group)
        hop = 0 if stage.last else mine * d * ACT_BYTES
        hop_bw = min(links.between(r, r + e) for r in group)
        a2a_s = max(dispatch / a2a_bw, moe * floor) if moe else 0.0
        stages.append(StageCost(stage.index, read, dispatch, read / links.hbm, a2a_s, hop,
                                hop / hop_bw + links.hop_latency if hop else 0.0))
    return StepEstimate(tuple(stages), batch)
