"""Continuous batching: requests come and go, and every step runs the ones that are ready.

The scheduler owns the requests and decides each step (step.StepPlan) within its limits (limits.Limits); an
executor runs it, in this process (executor.StageExecutor) or across pipeline stages (runtime/distributed/). One
iteration:

  1. admit waiting requests into free slots (they start prefilling);
  2. one prefill step over the prefilling requests: each feeds its next prompt chunk, and those whose prompt is
     complete sample their first token;
  3. one decode step over the decoding requests: each feeds its last token and samples the next.

Slots [0, n_decoding) hold the decoding requests and the prefilling ones follow, so both steps are contiguous slot
ranges. A finished or cancelled request frees its slot at once; the last request of its region moves into the
hole. A static batch (`k2trt generate`) is the same loop with every request submitted at the start.

The latent cache is paged (pages.py): a request takes pages for its prompt when admitted — after the longest
cached prefix it can reuse, whose positions it never computes — and one more page each time its decode crosses a
page's end. A request admits only when its pages are there; when a decoding request needs a page and none is left,
the newest request is preempted: its pages go back, its sampler is parked on the stage that samples, and it waits
at the front of the queue to feed its prompt and tokens again (recompute) and decode on with the same sampler, so
its tokens are the ones it would have had. Full pages (prompt and generated tokens: a conversation's next turn
resends the reply) are published for reuse once their latents are written; rank 0's scheduler decides every hit,
and each stage reads its own layers' pages of it.

Each request brings its own stop rules (runtime/text/text_stream.StopRules): its stop ids end it, and its text
stream, fed every kept token once, ends it at a stop string and gives the text to show. A request may also bring a
grammar its tokens follow (its sampler masks by it) and ask for log-probabilities (SamplingParams.logprobs,
prompt_logprobs): the executor's step gives them beside the tokens, and the request keeps them with its tokens.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import astuple, dataclass, field, replace
from typing import Callable

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.cache.sizing import CAPACITY_STEPS, bucket, grown_rows
from k2trt.runtime.generation.interfaces import BatchScheduler, Executor
from k2trt.runtime.generation.limits import ContextTooLong, Limits, RequestError
from k2trt.runtime.cache.pages import PagePool, page_keys, pages_for
from k2trt.runtime.generation.sampling import DEFAULTS, SamplingParams
from k2trt.runtime.generation.speculation import (DraftBackoff, DraftLength, SpecCounters, SpeculativeConfig,
                                                  SpeedPolicy)
from k2trt.runtime.generation.step import DECODE, PREFILL, Admit, Drop, Move, Park, Release, SlotOp, StepPlan, Swap
from k2trt.runtime.generation.timings import Timings
from k2trt.runtime.text.text_stream import NO_STOPS, StopRules, TextStream

FINISH_LENGTH, FINISH_STOP_TOKEN, FINISH_STOP_STRING, FINISH_CANCELLED = "length", "stop_token", "stop_string", \
    "cancelled"

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = DEFAULTS
    stops: StopRules = NO_STOPS  # its stop ids and strings, and how its text is decoded
    # each kept token as it is sampled, with the text it lets the display show now (often "", never a stop token)
    on_token: Callable[["Request", int, str], None] | None = None
    on_finish: Callable[["Request", str], None] | None = None  # its end, with the last of its text (held till now)
    on_prefill: Callable[["Request"], None] | None = None  # after each prompt chunk (progress of long prompts)
    grammar: object = None  # a runtime/text/grammar.Grammar its tokens follow, or None
    id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    fed: int = 0  # tokens of `feed` in the cache
    cached: int = 0  # positions in the cache
    pending: int | None = None  # the last sampled token, not yet in the cache
    cancelled: bool = False  # set from anywhere; honoured at the next iteration
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # when it took a slot (None while it waits)
    first_token_at: float | None = None
    finished_at: float | None = None
    logprobs: list = field(default_factory=list)  # sampling.TokenLogprob of each token in token_ids (if asked)
    prompt_logprobs: list = field(default_factory=list)  # of each prompt token, None for the first (if asked)
    table: list[int] = field(default_factory=list)  # its cache pages, in position order (pages.py)
    backoff: DraftBackoff = field(default_factory=DraftBackoff)  # speculation's policy for it (speculation.py)
    part: int | None = None  # the pool's partition holding it (an expert-parallel rank): kept while it is parked,
    # since its sampler waits there
    cached_tokens: int | None = None  # prompt tokens its first admission reused from the prefix cache
    preemptions: int = 0
    resuming: bool = False  # feeding its prompt and tokens again after a preemption: it samples nothing till then
    feed: list[int] = field(init=False)  # what it prefills: its prompt; after a preemption, its tokens too
    text: TextStream | None = field(init=False)  # None without a tokenizer (token ids only)

    def __post_init__(self):
        self.text = self.stops.stream()
        self.feed = self.prompt
        self._keys: list[bytes] = []

    def held_keys(self, page_tokens: int, positions: int) -> list[bytes]:
        """The keys of the full pages of its first `positions` tokens (prompt, then generated: a conversation's
        next turn resends the reply), computed once each and extended as it grows: what it looks up in the
        prefix index when admitted and publishes as its pages fill."""
        full = positions // page_tokens
        if full > len(self._keys):
            done = len(self._keys) * page_tokens
            tokens = (self.prompt + self.token_ids)[done:full * page_tokens]
            self._keys += page_keys(tokens, page_tokens, self._keys[-1] if self._keys else b"")
        return self._keys[:full]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class SlotLayout:
    """Which request owns each slot: the decoding requests first, then the prefilling ones, both contiguous.
    Every change returns the slot operations that make the executors' caches and samplers follow."""

    def __init__(self):
        self.order: list[Request] = []
        self.decoding = 0

    def __len__(self) -> int:
        return len(self.order)

    def slot(self, req: Request) -> int:
        return next(i for i, r in enumerate(self.order) if r is req)

    def add(self, req: Request, resume: bool = False) -> list[SlotOp]:
        self.order.append(req)
        return [Admit(len(self.order) - 1, req.sampling, req.grammar, resume=req.id if resume else None,
                      part=req.part or 0)]

    def promote(self, req: Request) -> list[SlotOp]:
        """A prefilling request starts decoding: it moves to the front of the prefilling region."""
        i, j = self.slot(req), self.decoding
        self.decoding += 1
        if i == j:
            return []
        self.order[i], self.order[j] = self.order[j], self.order[i]
        return [Swap(i, j)]

    def remove(self, req: Request, park: bool = False) -> list[SlotOp]:
        """Its slot is freed (its sampler released, or parked under its id to resume)."""
        i = self.slot(req)
        ops: list[SlotOp] = [Park(i, req.id) if park else Release(i)]
        if i < self.decoding:  # fill the hole with the last decoding request; the hole moves to the boundary
            j = self.decoding - 1
            if i != j:
                self.order[i] = self.order[j]
                ops.append(Move(j, i))
            self.decoding -= 1
            i = j
        last = len(self.order) - 1
        if i != last:
            self.order[i] = self.order[last]
            ops.append(Move(last, i))
        self.order.pop()
        return ops

    def decoding_requests(self) -> list[Request]:
        return self.order[:self.decoding]

    def prefilling_requests(self) -> list[Request]:
        return self.order[self.decoding:]


@dataclass
class CacheCounters:
    """The prefix cache and the pool, for /metrics: prompt tokens looked up and found, preemptions (counters), and
    the pool's pages in use and in all, and the positions those pages span against the positions the running
    requests hold (read at the time asked, and their high-water marks: their ratio is what paging wastes)."""
    queried_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    pages_in_use: int = 0
    pages: int = 0
    positions_in_use: int = 0
    positions_held: int = 0
    peak_positions_in_use: int = 0  # the most since start, each after a step wrote its positions
    peak_positions_held: int = 0
    page_tokens: int = 0  # the same in every lane: kept, not summed

    def __add__(self, other: "CacheCounters") -> "CacheCounters":
        summed = CacheCounters(*(a + b for a, b in zip(astuple(self), astuple(other))))
        return replace(summed, page_tokens=max(self.page_tokens, other.page_tokens))


def kept_tokens(sampled) -> list:
    """A decode row's tokens: the one it sampled, or the 1 to 1 + k a verify row kept (a tuple)."""
    return list(sampled) if isinstance(sampled, tuple) else [sampled]


class Scheduler(BatchScheduler):
    def __init__(self, executor: Executor, cfg: K2Config, limits: Limits, prefix_cache: bool = True,
                 speculation: SpeculativeConfig | None = None, drafter=None):
        self.executor, self.cfg, self.limits = executor, cfg, limits
        if speculation is not None and not executor.verifies_drafts:
            raise K2Error("--speculative-config: this executor cannot verify drafts")
        self.speculation = speculation
        self.drafter = drafter  # an EAGLE-3 draft (runtime/generation/eagle.py), following every sequence
        if speculation is not None and speculation.method == "eagle3":
            if drafter is None:
                raise K2Error("--speculative-config eagle3: no draft was loaded")
            if not executor.captures_aux:
                raise K2Error("--speculative-config eagle3: this executor does not give the target's aux states")
            executor.aux_layers = drafter.aux_layers
            if not speculation.num_speculative_tokens_given and drafter.suggested_k:
                speculation = self.speculation = replace(speculation, num_speculative_tokens=drafter.suggested_k)
        self.spec_counters = SpecCounters()
        self.spec_policy = SpeedPolicy()
        self.draft_length = DraftLength()
        self.waiting: deque[Request] = deque()
        self.layout = SlotLayout()
        self.pool = PagePool(limits.cache_pages, limits.page_tokens, prefix_cache, parts=limits.cache_parts)
        self.rows = self.capacity = 0
        self._ops: list[SlotOp] = []
        self.timings = Timings()
        self.counters = CacheCounters()

    # ---- requests ------------------------------------------------------------------------------------
    def check(self, req: Request, name: str = "the prompt") -> None:
        """Every error a request can have, raised before any work (RequestError; ContextTooLong past the context)."""
        if req.max_new_tokens < 1:
            raise RequestError(f"max new tokens must be >= 1, got {req.max_new_tokens}", "max_new_tokens")
        if not req.prompt:
            raise RequestError(f"{name} is empty", "prompt")
        bad = [t for t in req.prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"{name} has token id {bad[0]} outside the vocabulary (size {self.cfg.vocab_size})",
                               "prompt")
        if len(req.prompt) + req.max_new_tokens > self.limits.max_context:
            raise ContextTooLong(name, len(req.prompt), req.max_new_tokens, self.limits.max_context)
        need, pool = pages_for(len(req.prompt) + req.max_new_tokens, self.pool.page_tokens), self.pool
        if need > pool.pages:
            whole = "the whole pool" if pool.parts == 1 else "a rank's whole pool"
            raise RequestError(f"{name} has {len(req.prompt)} tokens; with {req.max_new_tokens} new tokens it needs "
                               f"{need} cache pages, more than {whole} of {pool.pages} "
                               f"({pool.pages * pool.page_tokens} positions)", "prompt")

    def submit(self, req: Request) -> Request:
        """Queue a request its submitter has check()ed: generate checks every prompt before it submits any, the
        server before it answers (on the event loop, so a bad request never reaches the scheduler's thread)."""
        self.waiting.append(req)
        return req

    @property
    def samples_here(self) -> bool:
        """Whether this process samples (so grammars and log-probabilities can apply): not a pipeline's rank 0."""
        return self.executor.samples_here

    def has_work(self) -> bool:
        return bool(self.waiting or len(self.layout))

    def running(self) -> int:
        return len(self.layout)

    def cache_counters(self) -> CacheCounters:
        in_use = self.pool.in_use
        return replace(self.counters, pages_in_use=in_use, pages=self.pool.total, page_tokens=self.pool.page_tokens,
                       positions_in_use=in_use * self.pool.page_tokens,
                       positions_held=sum(r.cached for r in list(self.layout.order)))

    def _note_peak(self) -> None:
        """After a step's positions are written, before anything it finished lets its pages go."""
        c = self.counters
        c.peak_positions_in_use = max(c.peak_positions_in_use, self.pool.in_use * self.pool.page_tokens)
        c.peak_positions_held = max(c.peak_positions_held, sum(r.cached for r in self.layout.order))

    # ---- one iteration -----------------------------------------------------------------------------------
    def iteration(self) -> None:
        self._drop_cancelled()
        self._admit()
        prefilling = self.layout.prefilling_requests()
        if prefilling:
            self._prefill_step(prefilling)
        self._pages_for_decode()
        decoding = self.layout.decoding_requests()
        if decoding:
            self._decode_step(decoding)

    def keepalive(self) -> None:
        """An empty step: nothing computed, but every pipeline stage hears from rank 0 (an idle server's stages
        would otherwise time out waiting for the next plan) and pending slot operations are applied."""
        plan = StepPlan(first=0, tokens=[], starts=[], sample=[], rows=self.rows, capacity=self.capacity,
                        ops=self._ops, page_tokens=self.pool.page_tokens, pool_pages=self.pool.pages)
        self._ops = []
        self.executor.run(plan)

    def run_until_idle(self) -> None:
        while self.has_work():
            self.iteration()

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, FINISH_CANCELLED)
        for req in [r for r in self.layout.order if r.cancelled]:
            self._finish(req, FINISH_CANCELLED)

    def _admit(self) -> None:
        """Waiting requests, first come first served, while there is a slot and the pages for what they feed."""
        while self.waiting and len(self.layout) < self.limits.max_batch:
            req, pt = self.waiting[0], self.pool.page_tokens
            # a request asking for prompt log-probabilities computes its whole prompt (as vLLM's does)
            hit = self.pool.match_keys(req.held_keys(pt, len(req.feed) - 1)) \
                if req.sampling.prompt_logprobs is None else []
            part = self._place(req, hit)
            if part is not None and hit and self.pool.part_of(hit[0]) != part:
                # its prefix's latents are on a rank it cannot go to: it computes them
                self.pool.release(hit)
                hit = []
            table = self.pool.allocate(pages_for(len(req.feed), pt) - len(hit), part) if part is not None else None
            if table is None:
                self.pool.release(hit)
                return
            self.waiting.popleft()
            req.table, req.part = hit + table, part
            req.fed = req.cached = len(hit) * pt
            if self.drafter is not None and req.cached:  # the draft's cache over the pages it reuses
                self.drafter.restore(req.id, req.held_keys(pt, req.cached), req.prompt + req.token_ids, pt)
            if req.cached_tokens is None:
                req.cached_tokens = req.cached
                self.counters.queried_tokens += len(req.prompt)
                self.counters.hit_tokens += req.cached
            if req.admitted_at is None:
                req.admitted_at = time.monotonic()
            self._ops += self.layout.add(req, resume=req.resuming)

    def _place(self, req: Request, hit: list[int]) -> int | None:
        """The pool's partition (data-parallel rank) the request goes to, or None while it must wait: the one its
        parked sampler is on when it resumes; else the one holding the prefix it reuses, if that has a slot free;
        else the one with the fewest sequences (then the most pages available, then the lowest). A partition
        holds at most its share of the slots (Limits.part_batch)."""
        parts = self.pool.parts
        if parts == 1:
            return 0
        running = [0] * parts
        for r in self.layout.order:
            running[r.part] += 1
        room = [q for q in range(parts) if running[q] < self.limits.part_batch]
        if req.resuming:
            return req.part if req.part in room else None
        if hit and self.pool.part_of(hit[0]) in room:
            return self.pool.part_of(hit[0])
        return min(room, key=lambda q: (running[q], -self.pool.available_in(q), q), default=None)

    def _preempt(self, req: Request) -> None:
        """Free its pages and slot; it waits at the front of the queue to recompute what it held."""
        self.pool.release(req.table)
        req.table = []
        self.counters.preemptions += 1
        req.preemptions += 1
        park = bool(req.token_ids)  # decoding: its sampler has drawn, keep it; prefilling: start again afresh
        self._ops += self.layout.remove(req, park=park)
        if park:
            req.feed, req.resuming = req.prompt + req.token_ids[:-1], True
        else:
            req.prompt_logprobs = []
        req.fed = req.cached = 0
        self.waiting.appendleft(req)

    def _pages_for_decode(self) -> None:
        """A page for every decoding request whose next position starts one, preempting the newest request
        (last admitted) while none is left."""
        for req in list(self.layout.decoding_requests()):
            while self._running(req) and req.cached >= len(req.table) * self.pool.page_tokens:
                page = self.pool.allocate(1, req.part)
                if page is not None:
                    req.table += page
                else:  # the newest of its partition: only those pages are of use to it
                    self._preempt(max((r for r in self.layout.order if r.part == req.part),
                                      key=lambda r: r.admitted_at))

    def _running(self, req: Request) -> bool:
        return any(r is req for r in self.layout.order)

    def _publish(self, req: Request) -> None:
        """Its full pages whose latents are written (prompt and generated tokens), for other requests to reuse."""
        keys = self._written_keys(req)
        self.pool.publish(req.table, keys, len(keys))

    def _written_keys(self, req: Request) -> list[bytes]:
        """The keys of its full pages whose latents are written, as far as its tokens are known: a verify step's
        kept drafts are written before they are accepted."""
        return req.held_keys(self.pool.page_tokens, min(req.cached, len(req.prompt) + len(req.token_ids)))

    def _prefill_step(self, reqs: list[Request]) -> None:
        chunk = self._chunk_size(reqs)
        tokens = [r.feed[r.fed:r.fed + chunk] for r in reqs]
        sample = [r.fed + len(t) == len(r.feed) and not r.resuming for r, t in zip(reqs, tokens)]
        ids = self._run(PREFILL, reqs, tokens, [r.cached for r in reqs], sample)
        aux = self.executor.take_aux() if self.drafter is not None else None
        for r, t in zip(reqs, tokens):
            r.fed += len(t)
            r.cached += len(t)
            self._publish(r)
            if r.on_prefill and not r.resuming:
                r.on_prefill(r)
        self._note_peak()
        for r, tok in zip(reqs, ids):
            if tok is not None:
                self._ops += self.layout.promote(r)
                self._accept(r, tok)
            elif r.resuming and r.fed == len(r.feed):  # all it held is back: it decodes on from its last token
                self._ops += self.layout.promote(r)
                r.feed, r.fed, r.resuming = r.prompt, len(r.prompt), False
        if aux is not None:
            self._advance_drafts([(r, r.cached - len(t), len(t), aux[b])
                                  for b, (r, t) in enumerate(zip(reqs, tokens))])

    def _decode_step(self, reqs: list[Request]) -> None:
        speculate = self.speculation is not None and self.spec_policy.allow()
        drafts = self._drafts(reqs) if speculate else [[] for _ in reqs]
        t0 = time.perf_counter()
        ids = self._run(DECODE, reqs, [[r.pending, *d] for r, d in zip(reqs, drafts)], [r.cached for r in reqs],
                        [True] * len(reqs), [len(d) for d in drafts] if any(drafts) else [])
        pt = self.pool.page_tokens
        kept = [kept_tokens(x) for x in ids]
        aux = self.executor.take_aux() if self.drafter is not None else None
        starts = [r.cached for r in reqs]
        if self.speculation is not None:
            self.spec_policy.observe(time.perf_counter() - t0, sum(map(len, kept)), any(drafts))
        for r, d, toks in zip(reqs, drafts, kept):
            if d:
                self.spec_counters.add(len(d), len(toks) - 1)
                r.backoff.verified(len(toks) - 1)
                self.draft_length.observe(len(d), len(toks) - 1)
            before = r.cached
            r.cached += len(toks)  # its last token and the drafts kept: the rest of what it wrote is overwritten
            if r.cached // pt > before // pt:
                self._publish(r)
        self._note_peak()
        for r, toks in zip(reqs, kept):
            for tok in toks:  # one at a time, as decoding without drafts gives them: stops cut the rest
                self._accept(r, tok)
                if r.done:
                    break
            if len(toks) > 1:
                del r.logprobs[len(r.token_ids):]  # of tokens a stop cut off
                if self._running(r):
                    self._publish(r)  # the pages its kept drafts filled
        if aux is not None:  # the committed positions: its last token and the drafts kept
            self._advance_drafts([(r, start, len(toks), aux[b])
                                  for b, (r, start, toks) in enumerate(zip(reqs, starts, kept))])

    def _advance_drafts(self, rows: list[tuple]) -> None:
        """The draft over positions start .. start + n − 1 of each (request, start, n, aux), each paired with the
        token after it; a finished request's draft state is dropped."""
        items = []
        for req, start, n, aux in rows:
            if req.done:
                self.drafter.forget(req.id)
                continue
            following = (req.prompt + req.token_ids)[start + 1:start + n + 1]
            items.append((req.id, start, following, aux[:len(following)]))
        self.drafter.advance_many(items)
        for req, _, _, _ in rows:  # its full pages, for prefix hits of later requests (the pages _publish publishes)
            if not req.done and self.pool.prefix_cache:
                self.drafter.keep_pages(req.id, self._written_keys(req), req.prompt + req.token_ids,
                                        self.pool.page_tokens)

    def _drafts(self, reqs: list[Request]) -> list[list[int]]:
        """The draft tokens each decoding request proposes this step, as many as its token budget, the context and
        the pages it holds or can take now allow (an EAGLE-3 draft proposes for all of them in one batch)."""
        spec = self.speculation
        k = self.draft_length.k(spec.num_speculative_tokens)  # the positions still kept often enough
        rooms = [min(r.max_new_tokens - len(r.token_ids) - 1, self.limits.max_context - r.cached - 1, k)
                 if r.backoff.ready() else 0 for r in reqs]
        if self.drafter is not None:
            asks = [(r.id, room) for r, room in zip(reqs, rooms) if room > 0]
            by_id = dict(zip([key for key, _ in asks], self.drafter.propose_many(asks)))
            proposals = [by_id.get(r.id, []) for r in reqs]
        else:
            proposals = [spec.propose(r.prompt + r.token_ids, room) if room > 0 else []
                         for r, room in zip(reqs, rooms)]
        return [self._fit_drafts(r, d) for r, d in zip(reqs, proposals)]

    def _fit_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """The drafts the request's pages hold, taking free pages where they are (never preempting)."""
        pt = self.pool.page_tokens
        while drafts and req.cached + 1 + len(drafts) > len(req.table) * pt:
            page = self.pool.allocate(1, req.part)  # a draft never preempts anyone: it shortens instead
            if page is None:
                drafts = drafts[:len(req.table) * pt - req.cached - 1]
            else:
                req.table += page
        return drafts

    def _run(self, kind: str, reqs: list[Request], tokens: list[list[int]], starts: list[int],
             sample: list[bool], drafts: list[int] | None = None) -> list:
        self._size_cache(max(s + len(t) for s, t in zip(starts, tokens)))
        plan = StepPlan(first=self.layout.slot(reqs[0]), tokens=tokens, starts=starts, sample=sample,
                        rows=self.rows, capacity=self.capacity, ops=self._ops, tables=[list(r.table) for r in reqs],
                        page_tokens=self.pool.page_tokens, pool_pages=self.pool.pages, drafts=drafts or [])
        self._ops = []
        t0 = time.perf_counter()
        ids = self.executor.run(plan)
        # tokens computed (prefill) or generated (decode: a verify row's every token kept)
        n = sum(len(t) for t in tokens) if kind == PREFILL else sum(len(kept_tokens(x)) for x in ids)
        self.timings.add_step(kind, time.perf_counter() - t0, n)
        if any(r.sampling.logprobs is not None or r.sampling.prompt_logprobs is not None for r in reqs):
            self._keep_logprobs(reqs, self.executor.take_logprobs())
        return ids

    @staticmethod
    def _keep_logprobs(reqs: list[Request], step) -> None:
        """The step's log-probabilities (step.StepLogprobs) onto their requests, before their tokens are
        accepted (a token's entry is there when its on_token runs)."""
        for b, entries in step.prompt.items():
            reqs[b].prompt_logprobs += entries
        for b, entry in step.sampled.items():
            reqs[b].logprobs.append(entry)
        for b, entries in step.verified.items():
            reqs[b].logprobs += entries

    def _capacity_for(self, step_needs: int) -> int:
        """The positions a step writing up to `step_needs` positions spans (its cache is gathered from its own
        sequences' pages): bucketed, so the graphs' P takes few values — four an octave, since attention's work
        follows P (a power of two would nearly double a 2,100-position prompt's)."""
        return bucket(step_needs, self.limits.max_context, per_octave=CAPACITY_STEPS)

    def _size_cache(self, step_needs: int) -> None:
        """Rows and capacity for the next step."""
        self.capacity = self._capacity_for(step_needs)
        self.rows = grown_rows(self.rows, len(self.layout), self.limits.max_batch)

    def _chunk_size(self, reqs: list[Request]) -> int:
        """Prompt tokens per request in this step: the chunk, halved while the step's mask would exceed the budget
        (it spans the cache's capacity, so long prompts and long neighbours make smaller chunks)."""
        chunk = self.limits.prefill_chunk
        while chunk > 16:
            need = max(r.cached + min(chunk, len(r.feed) - r.fed) for r in reqs)
            if len(reqs) * chunk * (self._capacity_for(need) + chunk) <= self.limits.mask_budget:
                break
            chunk //= 2
        return chunk

    # ---- tokens and finishing ------------------------------------------------------------------------------
    def _accept(self, req: Request, tok: int) -> None:
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
        req.token_ids.append(tok)
        req.pending = tok
        shown = req.text.feed(tok) if req.text is not None else ""
        if req.on_token:
            req.on_token(req, tok, shown)
        if tok in req.stops.ids:
            self._finish(req, FINISH_STOP_TOKEN)
        elif req.text is not None and req.text.stopped:
            self._finish(req, FINISH_STOP_STRING)
        elif len(req.token_ids) >= req.max_new_tokens:
            self._finish(req, FINISH_LENGTH)

    def _finish(self, req: Request, reason: str) -> None:
        if req.done:
            return
        req.finish_reason, req.finished_at = reason, time.monotonic()
        if self._running(req):
            self._ops += self.layout.remove(req)
        elif req.resuming:  # parked: its sampler is dropped
            self._ops.append(Drop(req.id))
        self.pool.release(req.table)
        req.table = []
        rest = req.text.finish() if req.text is not None else ""
        if req.on_finish:
            req.on_finish(req, rest)
