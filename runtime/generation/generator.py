"""Generation of a batch of prompts over any backend: the scheduler (runtime/generation/scheduler.py) with every request
submitted at the start, run until all are done.

Each sequence keeps its own positions (its first token is position 0), its own cache slot and its own seeded
sampler, so a sequence computes what it would alone, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.backends.contract import Backend
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import DEFAULT_PREFILL_CHUNK, FINISH_LENGTH, Request, Scheduler
from k2trt.runtime.generation.timings import Timings, TimingProbe

DEFAULT_SLOTS = 64  # sequences decoded together when the backend sets no limit


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH  # length | stop_token | stop_string


def context_limit(cfg: K2Config, backend: Backend, requested: int | None) -> int:
    """The tightest of: the model's, the caller's, and what the backend was built for (TensorRT profiles)."""
    if requested is not None and requested < 1:
        raise K2Error(f"--max-context must be >= 1, got {requested}")
    return min(x for x in (cfg.max_position_embeddings, requested, backend.limits.max_context) if x)


class Generator:
    def __init__(self, backend: Backend, cfg: K2Config, stop_ids: tuple[int, ...] = (),
                 max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_batch: int | None = None, executor=None):
        self.backend, self.cfg, self.stop_ids = backend, cfg, tuple(stop_ids)
        self.max_context = context_limit(cfg, backend, max_context)
        limits = backend.limits
        self.prefill_chunk = min(x for x in (prefill_chunk, limits.max_tokens_per_step) if x)
        self.max_batch = min(x for x in (max_batch or DEFAULT_SLOTS, limits.max_batch) if x)
        self.executor = executor or StageExecutor(backend, cfg)
        self.scheduler = Scheduler(self.executor, cfg, max_slots=self.max_batch, max_context=self.max_context,
                                   stop_ids=self.stop_ids, prefill_chunk=self.prefill_chunk)

    def requests(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                 on_token, stop_check, on_prefill) -> list[Request]:
        if not prompts:
            raise K2Error("no prompts given")
        reqs = []
        for i, p in enumerate(prompts):
            req = Request(list(p), max_new_tokens, sampling,
                          stop_check=None if stop_check is None else (lambda ids, i=i: stop_check(i, ids)),
                          on_token=None if on_token is None else (lambda r, t, i=i: on_token(i, t)),
                          on_prefill=on_prefill)
            self.scheduler.check(req, f"prompt {i}")
            reqs.append(req)
        return reqs

    def check(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams()) -> None:
        """Raise the K2Error generate would raise for these requests, without doing any work."""
        self.requests(prompts, max_new_tokens, sampling, None, None, None)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 on_token: Callable[[int, int], None] | None = None,
                 stop_check: Callable[[int, list[int]], bool] | None = None,
                 on_prefill: Callable[[Request], None] | None = None) -> tuple[list[Result], Timings]:
        """on_token(seq, id) streams each kept token; stop_check(seq, ids) -> True ends a sequence (stop strings);
        on_prefill(request) follows a long prompt's chunks. Every error is raised before any work."""
        reqs = self.requests(prompts, max_new_tokens, sampling, on_token, stop_check, on_prefill)
        sched = self.scheduler
        sched.timings = Timings()
        probe = TimingProbe(self.executor)
        for req in reqs:
            sched.submit(req)
        sched.run_until_idle()
        results = [Result(r.prompt, r.token_ids, r.finish_reason) for r in reqs]
        return results, probe.finish(sched.timings)
