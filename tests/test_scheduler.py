"""The scheduler alone (runtime/generation/scheduler.py), against a fake executor: random admissions, finishes
and cancels, with the slot layout's invariants asserted after every step.

The fake executor keeps what a real one keeps — the ids written to each row of the paged cache, and per slot its
sampler's params (parked ones too) — and applies the plans' slot operations (Admit, Release, Park, Drop, Move,
Swap) as StageExecutor.apply does. The token it "samples" for a sequence depends only on what the sequence reads
through its page table and its seed, so a request whose slot or pages the bookkeeping mixed up (a Move to the
wrong place, a Swap not followed, a page shared that was not the same prefix, a page written under a reader, a
preempted request that did not come back as it was) gets a token from someone else's cache or seed and its tokens
differ from the ones it gets alone."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2trt.config import K2Config
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import (FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP_TOKEN, Request,
                                               Scheduler)
from k2trt.runtime.generation.step import Admit, Drop, Move, Park, Release, StepPlan, Swap
from k2trt.runtime.text.text_stream import StopRules

CFG = K2Config.preset("tiny")
IDS = 16  # token ids in play: small, so stop tokens come up often


def next_token(cache: list[int], seed: int) -> int:
    """The fake model: a token from everything the slot holds, in order, and the request's own seed."""
    h = seed
    for t in cache:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % IDS


def alone(prompt: list[int], seed: int, max_new: int, stop_ids: frozenset[int]) -> list[int]:
    """The tokens a request gets with the whole machine to itself."""
    cache, out = list(prompt), []
    while len(out) < max_new:
        out.append(next_token(cache, seed))
        if out[-1] in stop_ids:
            break
        cache.append(out[-1])
    return out


class FakeExecutor:
    def __init__(self):
        self.rows: dict[int, int] = {}  # pool row -> the id written there
        self.params: dict[int, SamplingParams] = {}  # slot -> its sampler's params
        self.parked: dict[int, SamplingParams] = {}
        self.plans: list[StepPlan] = []
        self.scheduler: Scheduler | None = None  # set once made: each step is checked against its layout

    def __deepcopy__(self, memo):
        twin = FakeExecutor()
        twin.rows, twin.params, twin.parked = dict(self.rows), dict(self.params), dict(self.parked)
        return twin

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Admit):
                assert op.slot not in self.params, f"admitted into occupied slot {op.slot}"
                self.params[op.slot] = self.parked.pop(op.resume) if op.resume is not None else op.sampling
            elif isinstance(op, Release):
                assert op.slot in self.params, f"released empty slot {op.slot}"
                del self.params[op.slot]
            elif isinstance(op, Park):
                assert op.slot in self.params and op.key not in self.parked, op
                self.parked[op.key] = self.params.pop(op.slot)
            elif isinstance(op, Drop):
                assert op.key in self.parked, op
                del self.parked[op.key]
            elif isinstance(op, Move):
                assert op.src in self.params and op.dst not in self.params, op
                self.params[op.dst] = self.params.pop(op.src)
            elif isinstance(op, Swap):
                assert op.a in self.params and op.b in self.params, op
                self.params[op.a], self.params[op.b] = self.params[op.b], self.params[op.a]
            else:
                raise AssertionError(f"unknown slot op {op!r}")

    def read(self, table: list[int], positions: int, pt: int) -> list[int]:
        return [self.rows[table[p // pt] * pt + p % pt] for p in range(positions)]

    def run(self, plan: StepPlan) -> list[int | None]:
        self.plans.append(plan)
        self.apply(plan.ops)
        assert all(slot < plan.rows for slot in self.params), (sorted(self.params), plan.rows)
        if self.scheduler is not None:
            check_step(self.scheduler, plan)
        pt, pool = plan.page_tokens, self.scheduler.pool if self.scheduler is not None else None
        out: list[int | None] = []
        for b, (tokens, start, sample, table) in enumerate(zip(plan.tokens, plan.starts, plan.sample, plan.tables)):
            slot = plan.first + b
            assert slot in self.params, f"step on empty slot {slot}"
            assert tokens and start + len(tokens) <= plan.capacity
            held = self.read(table, start, pt)  # a KeyError: a position it holds was never written
            for p, tok in enumerate(tokens, start):
                page = table[p // pt]
                if pool is not None:  # a page is written only by its one holder, before anyone may reuse it
                    assert pool.refs[page] == 1 and page not in pool.key_of, (page, pool.refs[page])
                self.rows[page * pt + p % pt] = tok
            out.append(next_token(held + tokens, self.params[slot].seed) if sample else None)
        return out


def check_invariants(sched: Scheduler, executor: FakeExecutor, requests: list[Request], finished: list) -> None:
    layout = sched.layout
    order = layout.order
    assert len({id(r) for r in order}) == len(order) <= sched.limits.max_batch
    assert 0 <= layout.decoding <= len(order)
    for r in layout.decoding_requests():  # decoding: prompt all in, a token sampled and not yet fed
        assert r.fed == len(r.prompt) and r.token_ids and r.pending == r.token_ids[-1] and not r.done
        assert not r.resuming
    for r in layout.prefilling_requests():  # prefilling: part of what it feeds in, nothing sampled unless resuming
        assert r.fed < len(r.feed) and (not r.token_ids or r.resuming) and not r.done
    # every request is waiting, running or done, and only one of them
    waiting, running = {id(r) for r in sched.waiting}, {id(r) for r in order}
    for r in requests:
        assert [id(r) in waiting, id(r) in running, r.done].count(True) == 1, r
    # the executor's slots, once the operations still to be sent are applied, are exactly the layout's
    state = copy.deepcopy(executor)
    state.apply(sched._ops)
    assert sorted(state.params) == list(range(len(order)))
    pool, pt = sched.pool, sched.pool.page_tokens
    for slot, r in enumerate(order):  # what it reads through its pages is what it holds
        assert state.read(r.table, r.cached, pt) == (r.prompt + r.token_ids)[:r.cached], (slot, r.id)
        assert state.params[slot] == r.sampling and len(r.table) * pt >= r.cached
    # every page is referenced once by each running request whose table lists it, and by nobody else
    refs = [0] * pool.pages
    for r in order:
        for page in r.table:
            refs[page] += 1
    assert refs == pool.refs
    assert sorted(state.parked) == sorted(r.id for r in sched.waiting if r.resuming)
    # each finished request finished once, with the tokens it gets alone
    assert len(finished) == len({id(r) for r in finished}) == sum(r.done for r in requests)
    for r in finished:
        expect = alone(r.prompt, r.sampling.seed, r.max_new_tokens, r.stops.ids)
        if r.finish_reason == FINISH_CANCELLED:
            assert r.token_ids == expect[:len(r.token_ids)]
        else:
            assert r.token_ids == expect, r.id
            assert r.finish_reason == (FINISH_STOP_TOKEN if expect[-1] in r.stops.ids else FINISH_LENGTH)


def check_step(sched: Scheduler, plan: StepPlan) -> None:
    """A step is one contiguous slot range, all decoders [0, d) or all prefillers [d, n), and each sequence feeds
    what its request has next: its next prompt chunk from its cached position, or its last token."""
    layout = sched.layout
    assert (plan.first, plan.batch) in ((0, layout.decoding), (layout.decoding, len(layout) - layout.decoding))
    assert plan.batch and plan.first + plan.batch <= plan.rows
    for b, (tokens, start, sample) in enumerate(zip(plan.tokens, plan.starts, plan.sample)):
        r = layout.order[plan.first + b]
        assert start == r.cached
        if plan.first + b < layout.decoding:
            assert tokens == [r.pending] and sample
        else:
            assert tokens == r.feed[r.fed:r.fed + len(tokens)]
            assert sample == (r.fed + len(tokens) == len(r.feed) and not r.resuming)


PREFIXES = [[], [3, 1, 4, 1, 5, 9, 2, 6, 5], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]]  # prompts share these
submit = st.tuples(st.just("submit"), st.sampled_from(PREFIXES), st.lists(st.integers(0, IDS - 1), min_size=1,
                                                                          max_size=20),
                   st.integers(1, 12), st.integers(0, 3), st.sets(st.integers(0, IDS - 1), max_size=2))
cancel = st.tuples(st.just("cancel"), st.integers(0, 1000))
step = st.tuples(st.just("step"))
actions = st.lists(st.one_of(submit, submit, cancel, step, step, step), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions, max_batch=st.integers(1, 4), chunk=st.sampled_from([1, 3, 8, 32]),
       budget=st.sampled_from([1 << 22, 3000]), page_tokens=st.sampled_from([2, 4, 64]),
       pages=st.sampled_from([None, 24, 30]), prefix_cache=st.booleans())
def test_random_admits_finishes_and_cancels_keep_the_slot_layout(actions, max_batch, chunk, budget, page_tokens,
                                                                  pages, prefix_cache):
    """Every request's tokens are its tokens alone, through admissions, prefix hits, preemptions (a pool of 24 or
    30 small pages runs out), finishes and cancels."""
    executor = FakeExecutor()
    pages = pages and max(pages, -(-45 // page_tokens))  # the largest request fits the pool alone
    limits = Limits(max_context=64, max_batch=max_batch, prefill_chunk=chunk, mask_budget=budget,
                    cache_pages=pages or 0, page_tokens=page_tokens)
    sched = executor.scheduler = Scheduler(executor, CFG, limits, prefix_cache=prefix_cache)
    requests: list[Request] = []
    finished: list[Request] = []
    cancelled_in_flight: list[Request] = []

    for action in actions:
        if action[0] == "submit":
            _, prefix, tail, max_new, seed, stop_ids = action
            req = Request(prefix + tail, max_new, SamplingParams(seed=seed), StopRules(ids=frozenset(stop_ids)),
                          on_finish=lambda r, text: finished.append(r))
            sched.check(req)
            requests.append(sched.submit(req))
        elif action[0] == "cancel" and requests:
            req = requests[action[1] % len(requests)]
            if not req.done:
                cancelled_in_flight.append(req)
            req.cancelled = True
        else:
            sched.iteration()
            check_invariants(sched, executor, requests, finished)
    while sched.has_work():
        sched.iteration()
        check_invariants(sched, executor, requests, finished)
    assert all(r.done for r in requests) and not len(sched.layout) and not sched.waiting
    assert all(r.finish_reason == FINISH_CANCELLED for r in cancelled_in_flight)  # honoured before its next step
    assert sched.pool.in_use == 0  # every page given back
    state = copy.deepcopy(executor)
    state.apply(sched._ops)
    assert not state.params and not state.parked


def test_a_broken_move_is_caught():
    """The check itself: a layout whose Move goes to the wrong slot leaves a request on someone else's cache."""
    from k2trt.runtime.generation.scheduler import SlotLayout

    class WrongMove(SlotLayout):
        def remove(self, req):
            ops = super().remove(req)
            return [Move(op.src, op.src) if isinstance(op, Move) else op for op in ops]

    executor = FakeExecutor()
    sched = Scheduler(executor, CFG, Limits(max_context=64, max_batch=3, prefill_chunk=8))
    sched.layout = WrongMove()  # the executor checks no step: the invariants below must catch it
    reqs = [sched.submit(Request([i + 1] * 3, 6, SamplingParams(seed=i), on_finish=lambda r, t: None))
            for i in range(3)]
    sched.iteration()  # all three admitted, prefilled and decoding
    reqs[0].cancelled = True  # slot 0 frees: the last decoder should move into it
    try:
        for _ in range(3):
            sched.iteration()
            check_invariants(sched, executor, reqs, [r for r in reqs if r.done])
    except AssertionError:
        return
    raise AssertionError("a wrong Move went unnoticed")


def test_a_small_pool_preempts_and_reuses_and_every_request_keeps_its_own_tokens():
    """Seeded random traffic over a pool of 24 small pages shared by 4 slots, prompts sharing prefixes: requests
    are preempted (decoding and prefilling ones), resumed, cancelled while parked, and reuse cached prefixes; the
    invariants hold after every step and every request's tokens are its tokens alone. The run must have done all
    of that, or it proved nothing."""
    import random

    rnd = random.Random(1)
    seen = {"preemptions": 0, "hit_tokens": 0, "cancelled_parked": 0}
    for _ in range(150):
        executor = FakeExecutor()
        pt = rnd.choice([2, 4])
        limits = Limits(max_context=64, max_batch=4, prefill_chunk=rnd.choice([3, 8]),
                        cache_pages=max(24, -(-45 // pt)), page_tokens=pt)
        sched = executor.scheduler = Scheduler(executor, CFG, limits)
        requests: list[Request] = []
        finished: list[Request] = []
        for _ in range(60):
            x = rnd.random()
            if x < 0.35:
                prompt = rnd.choice(PREFIXES) + [rnd.randrange(IDS) for _ in range(rnd.randint(1, 20))]
                req = Request(prompt, rnd.randint(1, 12), SamplingParams(seed=rnd.randrange(4)),
                              on_finish=lambda r, text: finished.append(r))
                sched.check(req)
                requests.append(sched.submit(req))
            elif x < 0.45 and requests:
                req = rnd.choice(requests)
                seen["cancelled_parked"] += req.resuming and any(r is req for r in sched.waiting)
                req.cancelled = True
            else:
                sched.iteration()
                check_invariants(sched, executor, requests, finished)
        sched.run_until_idle()
        check_invariants(sched, executor, requests, finished)
        assert sched.pool.in_use == 0 and all(r.done for r in requests)
        seen["preemptions"] += sched.counters.preemptions
        seen["hit_tokens"] += sched.counters.hit_tokens
    assert all(seen.values()), seen
