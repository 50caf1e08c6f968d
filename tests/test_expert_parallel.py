"""Expert parallelism in one process: the MoE block's parts against the whole block, the dispatch's bookkeeping,
the scheduler's slots split over data-parallel ranks, and each rank's share of the weights. The same code across
real processes over gloo is in tests/test_pipeline.py (tokens against the single process).

E ranks are played here by E backends in one process, each holding its share of the experts, and the two
all-to-alls by the reference function below (what torch.distributed.all_to_all_single moves, rank by rank), so
every rank's side of an exchange runs the code the ranks run."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2trt.config import K2Config, expert_range
from k2trt.errors import K2Error
from k2trt.runtime.backends.factory import BackendChoice, open_backend
from k2trt.runtime.distributed.data_parallel import ColumnPlans
from k2trt.runtime.distributed.expert_parallel import (ExpertShare, plan_dispatch, received_expert_ids,
                                                       scatter_back)
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.text.text_stream import StopRules
from test_scheduler import PREFIXES, FakeExecutor, alone

TINY = K2Config.preset("tiny")


def all_to_all(sent: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """What every rank receives when rank s sends sent[s], cut by splits[s] (rows to each rank): from each source
    in rank order, as all_to_all_single lays them out."""
    ranks = len(sent)
    pieces = [list(torch.split(sent[s], splits[s])) for s in range(ranks)]
    return [torch.cat([pieces[s][r] for s in range(ranks)]) for r in range(ranks)]


def expert_parallel_layer(ranks, layer, shares, hidden, cos, sin, mask, cache, valid):
    """One MoE layer on E ranks (backends), each with its own sequences (shares; a rank with none runs no front
    and sends nothing, as ExpertParallelStage.run_idle): front, dispatch, experts, back, combine.
    -> (each rank's hidden out, latent new, Dispatch), None for an idle rank's first two."""
    e = len(ranks)
    k, d = TINY.num_experts_per_tok, TINY.hidden_size
    fronts = [be.moe_front(layer, hidden[i], cos[i], sin[i], mask[i], cache[i]) if len(i) else None
              for be, i in zip(ranks, shares)]
    empty = torch.zeros(0, 1, k, dtype=torch.int32)
    plans = [plan_dispatch(f[2] if f else empty, valid[i] if f else torch.zeros(0, 1, dtype=torch.bool),
                           TINY.n_routed_experts, e) for f, i in zip(fronts, shares)]
    rows = [f[1].reshape(-1, d)[p.order // k] if f else torch.zeros(0, d) for f, p in zip(fronts, plans)]
    received = all_to_all(rows, [p.send for p in plans])
    counts = all_to_all([p.expert_counts for p in plans], [[TINY.n_routed_experts // e] * e] * e)
    recv = [c.view(e, -1).sum(dim=1).tolist() for c in counts]
    outs = [be.moe_experts(layer, x, received_expert_ids(c.view(e, -1)), False) if len(x) else x
            for be, x, c in zip(ranks, received, counts)]
    back = all_to_all(outs, recv)
    hidden_out = [be.moe_combine(layer, scatter_back(b, p), f[3], f[4], f[0]) if f else None
                  for be, b, p, f in zip(ranks, back, plans, fronts)]
    return hidden_out, [f[5] if f else None for f in fronts], plans


def step_inputs(seed: int, b: int = 5, t: int = 3, p: int = 16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, TINY.hidden_size, generator=g)
    cos = torch.randn(b, t, TINY.qk_rope_head_dim // 2, generator=g)
    sin = torch.randn(b, t, TINY.qk_rope_head_dim // 2, generator=g)
    mask = torch.zeros(b, t, p + t)
    mask[..., :p] = -1e9  # fresh prompts: nothing cached
    mask[..., p:] = torch.triu(torch.full((t, t), -1e9), 1)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 2:] = valid[3, 1:] = False  # a ragged batch: padded positions send nothing
    return hidden, cos, sin, mask, torch.zeros(b, p, TINY.latent_dim), valid


@pytest.mark.parametrize("name, e", [("torch", 2), ("ort", 2), ("ort", 4), ("torch", 4)])
def test_the_parts_on_e_ranks_are_the_whole_block(tiny_ckpt, tiny_ep_exports, name, e):
    """Each rank's tokens through front → dispatch → its experts → back → combine give the single process's
    block output and cache entries (to float32 rounding: the GEMMs see other row counts than one batch's);
    at E = 4 one rank has no sequence of its own and still serves its experts."""
    from k2trt.checkpoint import Checkpoint

    ckpt = Checkpoint.open(tiny_ckpt)
    whole = open_backend(BackendChoice(name, tiny_ep_exports[e]), ckpt)
    ranks = [open_backend(BackendChoice(name, tiny_ep_exports[e], expert_parallel=e), ExpertShare(ckpt, e, r))
             for r in range(e)]
    hidden, cos, sin, mask, cache, valid = step_inputs(e)
    layer = 2
    ref, ref_new = whole.block(layer, hidden, cos, sin, mask, cache)
    shares = [[0, 1], [2], [3, 4]] + [[]] * (e - 3) if e > 2 else [[0, 1, 2], [3, 4]]
    shares = [torch.tensor(s, dtype=torch.long) for s in shares]
    outs, news, plans = expert_parallel_layer(ranks, layer, shares, hidden, cos, sin, mask, cache, valid)
    assert sum(sum(p.send) for p in plans) == int(valid.sum()) * TINY.num_experts_per_tok
    assert outs[-1] is None or e == 2  # E = 4: the idle rank
    for out, new, i in zip(outs, news, shares):
        if out is None:
            continue
        v = valid[i]
        torch.testing.assert_close(out[v], ref[i][v], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new, ref_new[i], rtol=1e-5, atol=1e-5)


def test_the_dispatch_sends_counts_then_rows_by_expert():
    """Pairs of real positions only, grouped by owning rank, by expert within it, in pair order within an expert;
    the receiver rebuilds each row's local expert from the counts; the outputs land back in pair order."""
    ids = torch.tensor([[[5, 1], [2, 6]], [[6, 0], [7, 3]]], dtype=torch.int32)  # [B=2, T=2, k=2], 8 experts
    valid = torch.tensor([[True, True], [True, False]])
    d = plan_dispatch(ids, valid, num_experts=8, ranks=2)  # rank 0: experts 0-3, rank 1: 4-7
    assert d.order.tolist() == [5, 1, 2, 0, 3, 4] and d.send == [3, 3] and d.pairs == 8
    assert d.expert_counts.tolist() == [1, 1, 1, 0, 0, 1, 2, 0]
    # rank 1 receives from rank 0 its counts [0, 1, 2, 0] and from rank 1 (itself) none: local experts 1, 2, 2
    recv = torch.tensor([[0, 1, 2, 0], [0, 0, 0, 0]])
    assert received_expert_ids(recv).tolist() == [1, 2, 2]
    back = torch.arange(6, dtype=torch.float32).unsqueeze(1)  # row j: the j-th pair sent
    pair_out = scatter_back(back, d)
    assert pair_out[:, 0].tolist() == [3, 1, 2, 4, 5, 0, 0, 0]  # pairs 6, 7 (a padded position): nothing


def test_an_adversarial_router_still_gives_the_whole_block(tiny_ckpt, tiny_ep_exports, tmp_path):
    """A router bias choosing only rank 0's experts: rank 1 sends everything and receives nothing, and the
    result is still the whole block's."""
    from k2trt.checkpoint import Checkpoint

    ckpt = Checkpoint.open(one_rank_router(tiny_ckpt, tmp_path / "biased"))
    whole = open_backend(BackendChoice("ort", tiny_ep_exports[2]), ckpt)
    ranks = [open_backend(BackendChoice("ort", tiny_ep_exports[2], expert_parallel=2), ExpertShare(ckpt, 2, r))
             for r in range(2)]
    hidden, cos, sin, mask, cache, valid = step_inputs(7)
    ref, _ = whole.block(1, hidden, cos, sin, mask, cache)
    shares = [torch.tensor([0, 1, 2]), torch.tensor([3, 4])]
    outs, _, plans = expert_parallel_layer(ranks, 1, shares, hidden, cos, sin, mask, cache, valid)
    assert all(p.send[1] == 0 and p.send[0] > 0 for p in plans)
    for out, i in zip(outs, shares):
        torch.testing.assert_close(out[valid[i]], ref[i][valid[i]], rtol=1e-5, atol=1e-5)


def one_rank_router(ckpt_dir, out):
    """A copy of a checkpoint whose every MoE router prefers experts 0..191 (rank 0's of two) by far: the
    correction bias only chooses, so the routing weights stay the model's own."""
    import json
    from pathlib import Path

    from fixtures import clone, rewrite_tensors

    index = json.loads((Path(ckpt_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    biases = [n for n in index if n.endswith("mlp.gate.e_score_correction_bias")]
    shards = sorted({index[n] for n in biases})
    bad = clone(Path(ckpt_dir), out, copy=(*shards, "model.safetensors.index.json"))
    first, stop = expert_range(TINY, 2, 0)

    def bias(tensors):
        for name in biases:
            if name in tensors:
                tensors[name][first:stop] += 100.0

    for shard in shards:
        rewrite_tensors(bad, shard, bias)
    return bad


# ---- the scheduler's slots over data-parallel ranks ----------------------------------------------------------

class ColumnsExecutor:
    """The scheduler's executor as rank 0 makes it: each plan split into one per rank (ColumnPlans), each run on
    that rank's own slots (the scheduler test's fake executor: a wrong slot gives a request someone else's
    tokens), the ids merged back."""

    def __init__(self, ranks: int, max_batch: int):
        self.columns = ColumnPlans(ranks, max_batch)
        self.ranks = [FakeExecutor() for _ in range(ranks)]
        self.busiest = 0

    def run(self, plan):
        plans = self.columns.split(plan)
        assert sum(p.batch for p in plans) == plan.batch
        ids = [r.run(p) for r, p in zip(self.ranks, plans)]
        self.busiest = max(self.busiest, *(len(r.params) for r in self.ranks))
        return self.columns.merge(plan, ids) if plan.tokens else []


submit = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 15), min_size=1, max_size=12),
                   st.integers(1, 8), st.integers(0, 3), st.sets(st.integers(0, 15), max_size=2), st.booleans())


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(submit, min_size=1, max_size=14), ranks=st.integers(2, 4), max_batch=st.integers(1, 6),
       chunk=st.sampled_from([1, 4, 32]), seed=st.integers(0, 1000), small_pool=st.booleans())
def test_each_rank_keeps_its_sequences_in_the_schedulers_order(requests, ranks, max_batch, chunk, seed, small_pool):
    """Requests come, stop, are cancelled, share prefixes and (with a small pool) are preempted; every rank's steps
    are contiguous ranges of its own slots holding the right sequences, every sequence reads only pages its own
    rank wrote (each fake rank has its own rows: a prefix reused from another rank is a KeyError), every request
    gets the tokens it gets alone, and no rank ever holds more than its max_batch sequences."""
    rng = random.Random(seed)
    executor = ColumnsExecutor(ranks, max_batch)
    # each rank's partition of the pool: 4-position pages, 9 hold the longest alone
    pages = max(max_batch, 9) if small_pool else 0
    sched = Scheduler(executor, TINY, Limits(max_context=64, max_batch=max_batch * ranks, prefill_chunk=chunk,
                                             cache_pages=pages, page_tokens=4, cache_parts=ranks))
    reqs = []
    for prefix, tail, max_new, s, stops, cancel in requests:
        prompt = prefix + tail
        req = sched.submit(Request(prompt, max_new, SamplingParams(seed=s), StopRules(ids=frozenset(stops)),
                                   on_finish=lambda r, t: None))
        reqs.append((req, cancel))
        if rng.random() < 0.4:
            sched.iteration()
        if cancel and rng.random() < 0.5:
            req.cancelled = True
    sched.run_until_idle()
    for req, _ in reqs:
        expect = alone(req.prompt, req.sampling.seed, req.max_new_tokens, req.stops.ids)
        assert req.token_ids == (expect[:len(req.token_ids)] if req.cancelled else expect)
    assert executor.busiest <= max_batch  # least loaded admission: no rank holds more than its share


# ---- a rank's share of the weights -----------------------------------------------------------------------------

def test_a_rank_reads_only_its_experts(tiny_ckpt):
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.distributed.session import stage_split, stage_tensors
    from k2trt.runtime.distributed.layout import Layout

    ckpt = Checkpoint.open(tiny_ckpt)
    full = ckpt.block_weights(1)
    for r in range(4):
        first, stop = expert_range(TINY, 4, r)
        mine = ExpertShare(ckpt, 4, r).block_weights(1)
        assert set(mine) == set(full)
        for name, t in mine.items():
            assert torch.equal(t, full[name][first:stop] if name.startswith("mlp.experts.") else full[name]), name
    stage = stage_split(TINY, Layout(2, 4), None).stages[1]
    names = stage_tensors(TINY, stage, expert_range(TINY, 4, 3))
    experts = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
    assert experts == set(range(288, 384)) and all(f"model.layers.{i}." in " ".join(names) for i in stage.layers)


def test_expert_ranges_are_contiguous_and_refused_where_they_do_not_divide():
    assert [expert_range(TINY, 8, r) for r in (0, 1, 7)] == [(0, 48), (48, 96), (336, 384)]
    with pytest.raises(K2Error, match=r"--expert-parallel 5 does not divide the 384 routed experts "
                                      r"\(nearest that do: 4 or 6\)"):
        expert_range(TINY, 5, 0)


def test_graphs_not_exported_for_the_expert_parallel_size_are_refused(tiny_ckpt, tiny_export, tiny_ep_exports):
    from k2trt.checkpoint import Checkpoint

    ckpt = Checkpoint.open(tiny_ckpt)
    with pytest.raises(K2Error, match=r"exported without --expert-parallel; --expert-parallel 2 needs graphs "
                                      r"from `k2trt export --expert-parallel 2`"):
        open_backend(BackendChoice("ort", tiny_export, expert_parallel=2), ckpt)
    with pytest.raises(K2Error, match="exported for --expert-parallel 4"):
        open_backend(BackendChoice("ort", tiny_ep_exports[4], expert_parallel=2), ckpt)


def test_the_export_holds_the_parts(tiny_ep_exports):
    from k2trt.export_manifest import read_manifest

    m = read_manifest(tiny_ep_exports[2])
    assert m["expert_parallel"] == 2 and m["layers"]["moe_front"] == m["layers"]["moe_block"]
    experts = m["graphs"]["trt/moe_experts"]
    assert experts["dispatch"] == {"top_k": 8, "ranks": 2}
    shapes = {i["name"]: i["shape"] for i in experts["inputs"]}
    assert shapes["expert_rows"] == ["R", TINY.hidden_size] and shapes["mlp.experts.gate_proj.weight"][0] == 192
    assert not m["graphs"]["trt/moe_combine"]["weights"]
    combine = {i["name"]: i["shape"] for i in m["graphs"]["trt/moe_combine"]["inputs"]}
    assert combine["pair_out"] == ["B*T*8", TINY.hidden_size]
