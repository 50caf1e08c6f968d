"""Generation of a batch of prompts over any backend: the scheduler (runtime/generation/scheduler.py) with every
request submitted at the start, run until all are done.

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
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import DEFAULTS, SamplingParams
from k2trt.runtime.generation.scheduler import FINISH_LENGTH, Request, Scheduler
from k2trt.runtime.generation.timings import Timings, TimingProbe
from k2trt.runtime.text.text_stream import NO_STOPS, StopRules


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = FINISH_LENGTH  # length | stop_token | stop_string
    text: str | None = None  # cut at the stop string; None without a tokenizer in the stop rules
    cached_tokens: int = 0  # prompt tokens whose latents came from the prefix cache (not computed)


class Generator:
    def __init__(self, backend: Backend, cfg: K2Config, limits: Limits | None = None, executor=None, scheduler=None):
        """limits: Limits.resolve's (the model's, the backend's and the defaults) unless given; scheduler: one over
        `executor` unless given (micro-batches in flight bring their own: runtime/distributed/micro_batches.py)."""
        self.backend, self.cfg = backend, cfg
        self.limits = limits or Limits.resolve(cfg, backend.limits)
        self.executor = executor or StageExecutor(backend, cfg)
        self.scheduler = scheduler or Scheduler(self.executor, cfg, self.limits)

    def requests(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                 stops: StopRules = NO_STOPS, on_text: Callable[[int, str], None] | None = None,
                 on_prefill=None) -> list[Request]:
        if not prompts:
            raise K2Error("no prompts given")
        reqs = []
        for i, p in enumerate(prompts):
            req = Request(list(p), max_new_tokens, sampling, stops, on_prefill=on_prefill, **_streaming(i, on_text))
            self.scheduler.check(req, f"prompt {i}")
            reqs.append(req)
        return reqs

    def check(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = DEFAULTS) -> None:
        """Raise the K2Error generate would raise for these requests, without doing any work."""
        self.requests(prompts, max_new_tokens, sampling)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = DEFAULTS,
                 stops: StopRules = NO_STOPS, on_text: Callable[[int, str], None] | None = None,
                 on_prefill: Callable[[Request], None] | None = None) -> tuple[list[Result], Timings]:
        """stops: what ends each sequence, and how its text is decoded (once per token); on_text(seq, text) streams
        the text a sequence can show, as it comes; on_prefill(request) follows a long prompt's chunks. Every error
        is raised before any work."""
        reqs = self.requests(prompts, max_new_tokens, sampling, stops, on_text, on_prefill)
        sched = self.scheduler
        sched.timings = Timings()
        probe = TimingProbe(self.executor)
        for req in reqs:
            sched.submit(req)
        sched.run_until_idle()
        results = [Result(r.prompt, r.token_ids, r.finish_reason, None if r.text is None else r.text.text,
                          r.cached_tokens or 0) for r in reqs]
        return results, probe.finish(sched.timings)


def _streaming(seq: int, on_text: Callable[[int, str], None] | None) -> dict:
    """A request's callbacks that hand its text to on_text(seq, text) as it comes, the last of it at the end."""
    if on_text is None:
        return {}

    def show(text: str) -> None:
        if text:
            on_text(seq, text)

    return {"on_token": lambda req, token, text: show(text), "on_finish": lambda req, text: show(text)}
