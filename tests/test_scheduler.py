"""The scheduler alone (runtime/generation/scheduler.py), against a fake executor: random admissions, finishes
and cancels, with the slot layout's invariants asserted after every step.

The fake executor keeps what a real one keeps — per slot, the ids written to its cache and its sampler's params —
and applies the plans' slot operations (Admit, Release, Move, Swap) as StageExecutor.apply does. The token it
"samples" for a slot depends only on what that slot holds and its seed, so a request whose slot the bookkeeping
mixed up (a Move to the wrong place, a Swap not followed, a stale slot) gets a token from someone else's cache and
its tokens differ from the ones it gets alone."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2trt.config import K2Config
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import (FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP_TOKEN, Request,
                                               Scheduler)
from k2trt.runtime.generation.step import Admit, Move, Release, StepPlan, Swap
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
        self.cache: dict[int, list[int]] = {}  # slot -> ids written, in position order
        self.params: dict[int, SamplingParams] = {}
        self.plans: list[StepPlan] = []
        self.scheduler: Scheduler | None = None  # set once made: each step is checked against its layout

    def __deepcopy__(self, memo):
        twin = FakeExecutor()
        twin.cache, twin.params = copy.deepcopy(self.cache), dict(self.params)
        return twin

    def apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, Admit):
                assert op.slot not in self.cache, f"admitted into occupied slot {op.slot}"
                self.cache[op.slot], self.params[op.slot] = [], op.sampling
            elif isinstance(op, Release):
                assert op.slot in self.cache, f"released empty slot {op.slot}"
                del self.cache[op.slot], self.params[op.slot]
            elif isinstance(op, Move):
                assert op.src in self.cache and op.dst not in self.cache, op
                self.cache[op.dst], self.params[op.dst] = self.cache.pop(op.src), self.params.pop(op.src)
            elif isinstance(op, Swap):
                assert op.a in self.cache and op.b in self.cache, op
                self.cache[op.a], self.cache[op.b] = self.cache[op.b], self.cache[op.a]
                self.params[op.a], self.params[op.b] = self.params[op.b], self.params[op.a]
            else:
                raise AssertionError(f"unknown slot op {op!r}")

    def run(self, plan: StepPlan) -> list[int | None]:
        self.plans.append(plan)
        self.apply(plan.ops)
        # the cache every stage resizes to holds every occupied slot and everything each slot holds
        assert all(slot < plan.rows for slot in self.cache), (sorted(self.cache), plan.rows)
        assert all(len(c) <= plan.capacity for c in self.cache.values()), plan.capacity
        if self.scheduler is not None:
            check_step(self.scheduler, plan)
        out: list[int | None] = []
        for b, (tokens, start, sample) in enumerate(zip(plan.tokens, plan.starts, plan.sample)):
            slot = plan.first + b
            assert slot in self.cache, f"step on empty slot {slot}"
            assert len(self.cache[slot]) == start, (slot, len(self.cache[slot]), start)
            assert tokens and start + len(tokens) <= plan.capacity
            self.cache[slot] += tokens
            out.append(next_token(self.cache[slot], self.params[slot].seed) if sample else None)
        return out


def check_invariants(sched: Scheduler, executor: FakeExecutor, requests: list[Request], finished: list) -> None:
    layout = sched.layout
    order = layout.order
    assert len({id(r) for r in order}) == len(order) <= sched.limits.max_batch
    assert 0 <= layout.decoding <= len(order)
    for r in layout.decoding_requests():  # decoding: prompt all in, a token sampled and not yet fed
        assert r.fed == len(r.prompt) and r.token_ids and r.pending == r.token_ids[-1] and not r.done
    for r in layout.prefilling_requests():  # prefilling: part of the prompt in, nothing sampled
        assert r.fed < len(r.prompt) and not r.token_ids and not r.done
    # every request is waiting, running or done, and only one of them
    waiting, running = {id(r) for r in sched.waiting}, {id(r) for r in order}
    for r in requests:
        assert [id(r) in waiting, id(r) in running, r.done].count(True) == 1, r
    # the executor's slots, once the operations still to be sent are applied, are exactly the layout's
    state = copy.deepcopy(executor)
    state.apply(sched._ops)
    assert sorted(state.cache) == list(range(len(order)))
    for slot, r in enumerate(order):
        assert state.cache[slot] == r.prompt[:r.fed] + r.token_ids[:r.cached - r.fed], (slot, r.id)
        assert r.cached == len(state.cache[slot]) and state.params[slot] == r.sampling
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
            assert tokens == r.prompt[r.fed:r.fed + len(tokens)] and sample == (r.fed + len(tokens) == len(r.prompt))


submit = st.tuples(st.just("submit"), st.lists(st.integers(0, IDS - 1), min_size=1, max_size=20),
                   st.integers(1, 12), st.integers(0, 3), st.sets(st.integers(0, IDS - 1), max_size=2))
cancel = st.tuples(st.just("cancel"), st.integers(0, 1000))
step = st.tuples(st.just("step"))
actions = st.lists(st.one_of(submit, submit, cancel, step, step, step), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions, max_batch=st.integers(1, 4), chunk=st.sampled_from([1, 3, 8, 32]),
       budget=st.sampled_from([1 << 22, 3000]))
def test_random_admits_finishes_and_cancels_keep_the_slot_layout(actions, max_batch, chunk, budget):
    executor = FakeExecutor()
    sched = executor.scheduler = Scheduler(executor, CFG, Limits(max_context=64, max_batch=max_batch,
                                                                 prefill_chunk=chunk, mask_budget=budget))
    requests: list[Request] = []
    finished: list[Request] = []
    cancelled_in_flight: list[Request] = []

    for action in actions:
        if action[0] == "submit":
            _, prompt, max_new, seed, stop_ids = action
            req = Request(prompt, max_new, SamplingParams(seed=seed), StopRules(ids=frozenset(stop_ids)),
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
