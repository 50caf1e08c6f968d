"""The latent cache sized per rank (runtime/cache/sizing.py): a rank's pool counts the layers it holds and its own
device; under expert parallelism each rank holds one partition of the scheduler's pool with its own page ids; a
rank keeps its page tables and a plan on the wire carries only what changed (step.PageTables)."""

from __future__ import annotations

import random

import pytest
import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.cache.pages import PagePool, page_keys, pages_for
from k2trt.runtime.cache.sizing import CacheBudget, page_bytes, pool_pages
from k2trt.runtime.distributed.pipeline import StepMessage, decode_message, encode_message
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.generation.step import PageTables

TINY = K2Config.preset("tiny")


# ---- a partitioned pool -----------------------------------------------------------------------------------

def test_each_partition_gives_out_only_its_own_pages():
    pool = PagePool(3, 4, parts=2)
    a = pool.allocate(3, part=1)
    assert a == [3, 4, 5] and pool.available_in(1) == 0 and pool.available_in(0) == 3
    assert pool.allocate(1, part=1) is None  # partition 0's free pages are of no use to a sequence of rank 1
    b = pool.allocate(2, part=0)
    assert b == [0, 1] and pool.total == 6 and pool.in_use == 5
    pool.release(a)
    assert pool.available_in(1) == 3 and pool.available_in(0) == 1
    assert [pool.part_of(p) for p in a + b] == [1, 1, 1, 0, 0]


def test_a_prefix_is_reused_from_the_partition_that_wrote_it():
    pool = PagePool(4, 4, parts=2)
    tokens = list(range(9))
    table = pool.allocate(pages_for(len(tokens), 4), part=1)
    pool.publish(table, page_keys(tokens, 4), 2)
    pool.release(table)
    hit = pool.match(tokens)
    assert hit == table[:2] and {pool.part_of(p) for p in hit} == {1}
    assert pool.allocate(4, part=1) is None  # its two pages are referenced again: never evicted under a reader


# ---- sizing --------------------------------------------------------------------------------------------------

def test_a_stage_holding_half_the_layers_fits_twice_the_pages():
    one = page_bytes(TINY, torch.float32)
    assert page_bytes(TINY, torch.float32, layers=2) * 2 == one
    memory = 40 * one
    alone = pool_pages([CacheBudget(memory, TINY.num_hidden_layers)], TINY, torch.float32, 4, 10_000)
    stages = pool_pages([CacheBudget(memory, 2, rank=0), CacheBudget(memory, 2, rank=1)], TINY, torch.float32, 4,
                        10_000)
    assert alone == 40 and stages == 80
    # the stage that fits fewest sets the pool: a stage of 3 layers beside one of 1
    uneven = pool_pages([CacheBudget(memory, 1, rank=0), CacheBudget(memory, 3, rank=1)], TINY, torch.float32, 4,
                        10_000)
    assert uneven == 40 * 4 // 3


def test_a_rank_too_small_for_its_slots_is_named():
    small = page_bytes(TINY, torch.float32, layers=3)
    budgets = [CacheBudget(100 * small, 1, "a", rank=0), CacheBudget(2 * small, 3, f"{2 * small:,} bytes", rank=1)]
    with pytest.raises(K2Error, match=r"--cache-memory .* holds 2 pages of .* bytes on rank 1 \(3 layers\); 4 slots"):
        pool_pages(budgets, TINY, torch.float32, 4, 10_000)


def test_the_gpu_default_share_is_capped_at_every_slot_and_an_asked_size_is_not():
    one = page_bytes(TINY, torch.float32)
    assert pool_pages([CacheBudget(500 * one, 4, "x", default=True)], TINY, torch.float32, 2, 64) == 64
    assert pool_pages([CacheBudget(500 * one, 4, "x")], TINY, torch.float32, 2, 64) == 500
    assert pool_pages([CacheBudget(None, 4)], TINY, torch.float32, 2, 64) is None


def test_loaded_model_limits_follow_every_ranks_budget(tiny_ckpt):
    """rank 0's limits: the pool is what every rank's budget holds, in one partition per expert-parallel rank."""
    from types import SimpleNamespace

    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.contract import BackendLimits
    from k2trt.runtime.distributed.layout import Layout
    from k2trt.runtime.entrypoints.model import LoadedModel

    class Named:
        limits, act_dtype, device = BackendLimits(), torch.float32, torch.device("cpu")

    ckpt = Checkpoint.open(tiny_ckpt)
    one = page_bytes(ckpt.config, torch.float32)
    memory = 30 * one
    alone = LoadedModel(Named(), None, ckpt).limits(512, 4, cache_memory=memory)
    assert (alone.cache_pages, alone.cache_parts) == (30, 1)
    session = SimpleNamespace(layout=Layout(2, 1), stage=SimpleNamespace(layers=[0, 1]))
    stages = LoadedModel(Named(), None, ckpt, session, cache_budgets=[CacheBudget(memory, 2, rank=r) for r in (0, 1)])
    assert stages.limits(512, 4, cache_memory=memory).cache_pages == 60
    session = SimpleNamespace(layout=Layout(1, 2), stage=SimpleNamespace(layers=[0, 1, 2, 3]))
    columns = LoadedModel(Named(), None, ckpt, session, cache_budgets=[CacheBudget(memory, 4, rank=r) for r in (0, 1)])
    limits = columns.limits(512, 4, cache_memory=memory)
    assert (limits.cache_pages, limits.cache_parts, limits.part_batch) == (30, 2, 2)


# ---- the scheduler over partitions ---------------------------------------------------------------------------

class Recorder:
    """An executor that samples token 7 everywhere and records each plan."""

    def __init__(self):
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        return [7 if s else None for s in plan.sample]


def test_a_sequence_takes_every_page_from_one_partition_and_partitions_fill_evenly():
    ex = Recorder()
    limits = Limits(max_context=256, max_batch=4, prefill_chunk=64, cache_pages=8, page_tokens=16, cache_parts=2)
    sched = Scheduler(ex, TINY, limits)
    rnd = random.Random(3)
    reqs = [sched.submit(Request([rnd.randrange(100) for _ in range(rnd.randint(5, 40))], 20, SamplingParams()))
            for _ in range(6)]
    seen_parts = set()
    while sched.has_work():
        sched.iteration()
        running = sched.layout.order
        for r in running:
            assert {sched.pool.part_of(p) for p in r.table} <= {r.part}, (r.table, r.part)
        assert all(sum(r.part == q for r in running) <= limits.part_batch for q in range(2))
        seen_parts |= {r.part for r in running}
    assert seen_parts == {0, 1} and all(len(r.token_ids) == 20 for r in reqs)
    assert sched.cache_counters().pages == 16  # both partitions


def test_a_waiting_prompt_is_hashed_once(monkeypatch):
    """A request's page keys are computed once and extended as it grows, however many admissions it waits through
    (they were hashed again at every attempt)."""
    from k2trt.runtime.cache import pages as P
    from k2trt.runtime.generation import scheduler as S

    hashed = []
    real = S.page_keys

    def counting(tokens, page_tokens, parent=b""):
        hashed.append((tokens[0] if tokens else None, len(tokens) // page_tokens))
        return real(tokens, page_tokens, parent)

    monkeypatch.setattr(S, "page_keys", counting)
    monkeypatch.setattr(P, "page_keys", counting)
    limits = Limits(max_context=256, max_batch=2, prefill_chunk=256, cache_pages=5, page_tokens=16)
    sched = Scheduler(Recorder(), TINY, limits)
    sched.submit(Request([1] * 70, 8, SamplingParams()))  # all five pages
    waiting = sched.submit(Request([2] * 40, 4, SamplingParams()))
    waited = 0
    while sched.has_work():
        sched.iteration()
        waited += waiting.admitted_at is None
    assert waited >= 3 and len(waiting.token_ids) == 4
    assert sum(n for first, n in hashed if first == 2) == 2  # its two full prompt pages, once each


# ---- page tables on the wire ---------------------------------------------------------------------------------

def _decode_blob(prompt_len: int) -> bytes:
    """The message of a decode step of one sequence after a prompt of prompt_len tokens, as rank 0 sends it to a
    rank that has followed every plan before it."""
    ex = Recorder()
    limits = Limits(max_context=9000, max_batch=2, prefill_chunk=512, cache_pages=160, page_tokens=64)
    sched = Scheduler(ex, TINY, limits)
    sched.submit(Request([5] * prompt_len, 5, SamplingParams()))
    sched.run_until_idle()
    sent, received = PageTables(), {}
    blobs = []
    for plan in ex.plans:
        blob = encode_message(StepMessage(0, plan, True, False), sent)
        got = decode_message(blob, received).plan
        assert got.tables == plan.tables and got.ops == plan.ops  # the rank rebuilds every table
        blobs.append(blob)
    return blobs[-1]


def test_a_decode_plan_is_as_long_at_8k_positions_as_at_1k():
    short, long = _decode_blob(1030), _decode_blob(8030)
    assert len(short) == len(long) and short != long, (short, long)


def test_page_tables_follow_slot_moves_preemptions_and_reuse_on_the_receiving_rank():
    """A small pool, prefix reuse, preemption and random finishes: every plan's tables come out on the rank as the
    scheduler made them."""
    ex = Recorder()
    limits = Limits(max_context=128, max_batch=3, prefill_chunk=8, cache_pages=9, page_tokens=4)
    sched = Scheduler(ex, TINY, limits)
    rnd = random.Random(11)
    prefix = [rnd.randrange(50) for _ in range(9)]
    for i in range(12):
        tail = [rnd.randrange(50) for _ in range(rnd.randint(1, 12))]
        sched.submit(Request((prefix if i % 2 else []) + tail, rnd.randint(1, 9), SamplingParams()))
        if rnd.random() < 0.5:
            sched.iteration()
    sched.run_until_idle()
    assert sched.counters.preemptions > 0 and sched.counters.hit_tokens > 0
    sent, received = PageTables(), {}
    for plan in ex.plans:
        got = decode_message(encode_message(StepMessage(0, plan, bool(plan.tokens), False), sent), received).plan
        assert got.tables == plan.tables


# ---- a stage's pool never passes its memory --------------------------------------------------------------------

@pytest.mark.parametrize("whole", [False, True])
def test_a_stage_never_reserves_more_than_its_memory(tiny_ckpt, tiny_export, whole):
    """A stage of two layers given M bytes holds the pool the scheduler sized from M, growing (CPU) or reserved at
    once (GPU, forced): its pools never pass M, with prompts that fill the pool and preempt."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.generation.executor import StageExecutor

    ckpt = Checkpoint.open(tiny_ckpt)
    backend = open_backend(BackendChoice("ort", tiny_export), ckpt)
    backend.prepare([0, 1], embedding=True, head=False)
    memory = 13 * page_bytes(ckpt.config, backend.act_dtype, 16, layers=2) + 100
    pages = pool_pages([CacheBudget(memory, 2)], ckpt.config, backend.act_dtype, 2, 10_000, page_tokens=16)
    assert pages == 13
    stage = StageExecutor(backend, ckpt.config, [0, 1], first=True, last=False)
    stage.reserve_whole = whole

    class FirstStage:  # the stage runs its layers; the scheduler gets a token for every sampling sequence
        def run(self, plan):
            stage.apply(plan)
            if plan.tokens:
                st = stage.tensors(plan)
                stage.run_layers(plan, st, stage.embed(st))
            return [3 if s else None for s in plan.sample]

    limits = Limits(max_context=128, max_batch=2, prefill_chunk=32, cache_pages=pages, page_tokens=16)
    sched = Scheduler(FirstStage(), ckpt.config, limits)
    for n in (70, 90, 40):
        sched.submit(Request(list(range(3, 3 + n)), 30, SamplingParams()))
    sched.run_until_idle()
    assert sched.counters.preemptions > 0
    assert stage.cache.pages <= pages and stage.cache.bytes <= memory
    if whole:
        assert stage.cache.pages == pages  # reserved at the first step, never grown


@pytest.mark.slow
def test_stages_and_expert_parallel_ranks_hold_more_positions_in_the_same_memory(tiny_ckpt, tiny_export,
                                                                                   tiny_ep_exports):
    """`serve --cache-memory M`: two pipeline stages (two layers each) and two expert-parallel ranks each hold at
    least 1.9x the pages of one process (read from /metrics), and answer with the same text."""
    import httpx
    from servers import InProcessServer, Server, metric

    from k2trt.checkpoint import Checkpoint

    memory = 20 * page_bytes(Checkpoint.open(tiny_ckpt).config, torch.float32)  # the fp32 graphs' cache
    body = {"model": "tiny", "prompt": list(range(3, 90)), "max_tokens": 6, "temperature": 0}

    def served(s) -> tuple[float, str]:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
        return metric(s.url, "k2trt:cache_pages_total"), r["choices"][0]["text"]

    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "4", "--cache-memory", str(memory)) as s:
        alone, text = served(s)
    assert alone == 20
    for export, flags in [(tiny_export, ["--pipeline", "2", "--stages", "2,2"]),
                          (tiny_ep_exports[2], ["--expert-parallel", "2"])]:
        s = Server(tiny_ckpt, export, "--max-batch", "4", "--cache-memory", str(memory), "--dist-timeout", "60",
                   *flags)
        try:
            pages, got = served(s)
            assert pages >= 1.9 * alone and got == text, (flags, pages, got, text)
        finally:
            assert s.stop() == 0, s.output()
