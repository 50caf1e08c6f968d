"""Expert parallelism: each of the E ranks of a stage holds 1/E of every MoE layer's routed experts (a contiguous
range, config.expert_range, as modeling_deepseek.py's DeepseekV3MoE assigns them) and every other weight whole;
attention is data parallel, each rank running its own sequences' attention over its own cache.

One MoE layer of a step, on every rank of the group at once (graphs/blocks.py has the three parts' math):

  moe_front (attention, router, shared expert) on the rank's own tokens
    -> dispatch: its (token, expert) pairs of real positions, sorted by expert (so by owning rank), and how many
       go to each expert — the counts first (all_to_all), then each pair's moe_input row (all_to_all, uneven)
    -> moe_experts: the grouped GEMM over the rank's experts, on the rows it received from every rank
    -> the outputs back, the reverse all_to_all, each row to the rank and place it came from
    -> moe_combine on the token's own rank: its k expert outputs weighted and summed in float32 in top-k order, then
       the shared expert and the residual — the sums the single process computes, in the same order.

A rank with no tokens in a step still takes part in every exchange (its experts may be others' choice). Padded
positions of a ragged batch send nothing. The exchange runs over the stage's expert-parallel process group — gloo
on CPUs, NCCL between GPUs, the same calls — and counts its time and the bytes that leave the rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k2trt.config import K2Config, expert_range
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.step import StepPlan, StepTensors, is_decode


# ---- one rank's share of the weights --------------------------------------------------------------------------

class ExpertShare:
    """A weight source seen by one expert-parallel rank: every tensor but the routed experts outside its range,
    which it never reads (Checkpoint.block_weights reads only the experts asked for)."""

    def __init__(self, inner, expert_parallel: int, expert_rank: int):
        self.inner, self.config = inner, inner.config
        self.experts = expert_range(inner.config, expert_parallel, expert_rank)

    def globals(self, names=None):
        return self.inner.globals(names)

    def block_weights(self, layer: int, experts: tuple[int, int] | None = None):
        return self.inner.block_weights(layer, self.experts if experts is None else experts)


# ---- the dispatch, as plain tensors (no process group: tests run every rank's side in one process) ----------

@dataclass
class Dispatch:
    """Where a rank's pairs go: `order` lists the pairs it sends (flat pair index t·k + j of its [B, T, k] routing,
    real positions only) grouped by destination rank, by expert within it, by pair index within an expert;
    expert_counts [n_routed_experts] how many go to each expert (what is sent first); send[r] rows to rank r."""

    order: torch.Tensor
    expert_counts: torch.Tensor
    send: list[int]
    pairs: int  # B·T·k: the size of the pair_out the combine takes


def plan_dispatch(topk_ids: torch.Tensor, valid: torch.Tensor, num_experts: int, ranks: int) -> Dispatch:
    """topk_ids [B, T, k] (global expert ids), valid [B, T] -> the Dispatch of this rank's pairs."""
    k = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1).long()
    real = torch.nonzero(valid.reshape(-1).repeat_interleave(k), as_tuple=True)[0]
    experts = ids[real]
    order = real[torch.argsort(experts, stable=True)]
    counts = torch.bincount(experts, minlength=num_experts)
    send = counts.view(ranks, -1).sum(dim=1).tolist()
    return Dispatch(order, counts, send, ids.numel())


def received_expert_ids(recv_counts: torch.Tensor) -> torch.Tensor:
    """recv_counts [sources, experts per rank]: pairs each source sent to each local expert -> the local expert id
    of every received row (rows arrive by source, and by expert within a source), int32."""
    per_rank = recv_counts.shape[1]
    local = torch.arange(per_rank, device=recv_counts.device).repeat(recv_counts.shape[0])
    return torch.repeat_interleave(local, recv_counts.reshape(-1)).to(torch.int32)


def scatter_back(returned: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """The expert outputs that came back, in the order sent -> pair_out [B·T·k, d] in pair order (zeros for the
    pairs of padded positions, which the combine computes but nobody reads)."""
    out = returned.new_zeros(dispatch.pairs, returned.shape[-1])
    out[dispatch.order.to(returned.device)] = returned
    return out


# ---- the exchange over a process group ----------------------------------------------------------------------

@dataclass
class ExchangeStats:
    seconds: float = 0.0  # inside the all-to-alls (waiting for the other ranks included)
    bytes_sent: int = 0  # rows and counts this rank sent to other ranks
    decode_bytes: int = 0  # of them, in decode steps


class ExpertExchange:
    """The two all-to-alls of one MoE layer over a stage's expert-parallel group; `lost` turns a failed collective
    into the one line naming the rank that went away (World.lost_contact)."""

    def __init__(self, cfg: K2Config, group, rank: int, size: int, device, lost):
        self.cfg, self.group, self.rank, self.size, self.device = cfg, group, rank, size, device
        self.lost = lost
        self.stats = ExchangeStats()

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None,
                    decode: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except RuntimeError as e:  # gloo and NCCL raise RuntimeError when a peer is gone or the timeout passes
            raise self.lost(e) from None
        finally:
            self.stats.seconds += time.perf_counter() - t0
        row = inp[0].numel() if inp.dim() > 1 and inp.shape[0] else 1
        own = inp.numel() // self.size if in_splits is None else in_splits[self.rank] * row  # stays on this rank
        sent = (inp.numel() - own) * inp.element_size()
        self.stats.bytes_sent += sent
        self.stats.decode_bytes += sent if decode else 0

    def dispatch(self, rows: torch.Tensor, dispatch: Dispatch, decode: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """rows [B·T, d] (this rank's moe_input) -> (the rows received [R, d], their local expert ids [R], rows
        received from each rank)."""
        counts = dispatch.expert_counts.to(self.device)
        recv_counts = torch.empty_like(counts)
        self._all_to_all(recv_counts, counts, decode=decode)  # counts first: [ranks × experts per rank] each way
        recv_counts = recv_counts.view(self.size, -1)
        recv = recv_counts.sum(dim=1).tolist()
        sent = rows[(dispatch.order // self.cfg.num_experts_per_tok).to(rows.device)]
        received = rows.new_empty(sum(recv), rows.shape[-1])
        self._all_to_all(received, sent, recv, dispatch.send, decode)
        return received, received_expert_ids(recv_counts), recv

    def give_back(self, expert_out: torch.Tensor, dispatch: Dispatch, recv: list[int], decode: bool) -> torch.Tensor:
        """The experts' outputs back to the ranks their rows came from -> this rank's pair_out [B·T·k, d]."""
        returned = expert_out.new_empty(sum(dispatch.send), expert_out.shape[-1])
        self._all_to_all(returned, expert_out.contiguous(), dispatch.send, recv, decode)
        return scatter_back(returned, dispatch)


# ---- a stage of one expert-parallel rank --------------------------------------------------------------------

class ExpertParallelStage(StageExecutor):
    """A StageExecutor whose MoE layers run split at the dispatch, exchanging rows with the other ranks of its
    stage. `run_idle` is the part of a step for a rank none of whose sequences are in it: it still serves its
    experts to the others."""

    def __init__(self, backend, cfg: K2Config, exchange: ExpertExchange, layers=None, first=True, last=True):
        super().__init__(backend, cfg, layers, first, last)
        self.exchange = exchange
        self.num_experts = cfg.n_routed_experts

    def run_block(self, layer: int, plan: StepPlan, st: StepTensors, hidden: torch.Tensor) -> torch.Tensor:
        if not self.cfg.is_moe_layer(layer):
            return super().run_block(layer, plan, st, hidden)
        backend, clock = self.backend, time.perf_counter
        cache, mask = self.layer_cache(layer, st)
        t0 = clock()
        residual, x, topk_ids, topk_weights, shared, new = backend.moe_front(layer, hidden, st.rope_cos, st.rope_sin,
                                                                             mask, cache)
        self.clock.backend_s += clock() - t0
        self.cache.write(layer, new, st.cache_rows, st.valid)
        dispatch = plan_dispatch(topk_ids.cpu(), st.valid.cpu(), self.num_experts, self.exchange.size)
        pair_out = self._serve(layer, x.reshape(-1, x.shape[-1]), dispatch, is_decode(plan))
        t0 = clock()
        hidden = backend.moe_combine(layer, pair_out, topk_weights, shared, residual)
        self.clock.backend_s += clock() - t0
        return hidden

    def _serve(self, layer: int, rows: torch.Tensor, dispatch: Dispatch, decode: bool) -> torch.Tensor:
        """Send this rank's pairs, run its experts on what it received, send the outputs back: -> pair_out."""
        received, expert_ids, recv = self.exchange.dispatch(rows, dispatch, decode)
        if received.shape[0]:
            t0 = time.perf_counter()
            expert_out = self.backend.moe_experts(layer, received, expert_ids.to(received.device), decode)
            self.clock.backend_s += time.perf_counter() - t0
        else:
            expert_out = received
        return self.exchange.give_back(expert_out, dispatch, recv, decode)

    def run_idle(self, decode: bool) -> None:
        """Every MoE layer's exchange with nothing of its own to send."""
        d = self.cfg.hidden_size
        empty = torch.empty(0, d, dtype=self.backend.act_dtype, device=self.backend.device)
        nothing = Dispatch(torch.empty(0, dtype=torch.long), torch.zeros(self.num_experts, dtype=torch.long),
                           [0] * self.exchange.size, 0)
        for layer in self.layers:
            if self.cfg.is_moe_layer(layer):
                self._serve(layer, empty, nothing, decode)
