"""Generation over any backend: the latent cache, the per-step rope tables and mask, prefill then decode.

Batches of prompts of different lengths are left-padded; each sequence keeps its own positions (the first
real token is position 0), so a padded sequence computes exactly what it would alone. Cache slot j of a
sequence holds the token at padded index j; the whole preallocated cache is handed to every block and the
mask hides the slots not yet written and the padding. New entries are written into the cache in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.mask import attention_mask
from k2trt.graphs.rope import rope_tables
from k2trt.runtime.sampling import Sampler, SamplingParams


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    backend_s: float = 0.0  # time inside the backend's embed/block/head calls
    session_s: float | None = None  # time inside the inference sessions, for backends that report it

    @property
    def host_s(self) -> float:
        """Time outside the sessions (outside the backend calls where a backend does not report sessions)."""
        inside = self.backend_s if self.session_s is None else self.session_s
        return self.prefill_s + self.decode_s - inside

    def as_dict(self) -> dict:
        tps = lambda n, s: round(n / s, 2) if s > 0 else None  # noqa: E731
        return {
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "prefill_tokens_per_s": tps(self.prefill_tokens, self.prefill_s),
            "decode_tokens_per_s": tps(self.decode_tokens, self.decode_s),
            "host_s": round(self.host_s, 4), "backend_s": round(self.backend_s, 4),
            "session_s": None if self.session_s is None else round(self.session_s, 4),
        }


@dataclass
class Result:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # length | stop_token | stop_string


class Generator:
    def __init__(self, backend, cfg: K2Config, stop_ids: tuple[int, ...] = (), max_context: int | None = None,
                 prefill_chunk: int = 512):
        self.backend = backend
        self.cfg = cfg
        self.stop_ids = tuple(stop_ids)
        # the tightest of: the model, the caller, and what the backend was built for (TensorRT profiles)
        limits = [cfg.max_position_embeddings, max_context, getattr(backend, "max_context", None)]
        self.max_context = min(x for x in limits if x)
        chunks = [prefill_chunk, getattr(backend, "max_tokens_per_step", None)]
        self.prefill_chunk = min(x for x in chunks if x)
        if self.prefill_chunk < 1:
            raise K2Error(f"prefill chunk must be >= 1, got {prefill_chunk}")

    def check_request(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Every error a request can have, raised before any work."""
        if not prompts:
            raise K2Error("no prompts given")
        if max_new_tokens < 1:
            raise K2Error(f"max new tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise K2Error(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise K2Error(f"prompt {i} has token id {bad[0]} outside the vocabulary (size {self.cfg.vocab_size})")
            if len(p) + max_new_tokens > self.max_context:
                raise K2Error(f"prompt {i} has {len(p)} tokens; with {max_new_tokens} new tokens that exceeds the "
                              f"context limit of {self.max_context}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 on_token: Callable[[int, int], None] | None = None,
                 stop_check: Callable[[int, list[int]], bool] | None = None) -> tuple[list[Result], Timings]:
        """on_token(seq, id) streams each kept token; stop_check(seq, ids) -> True ends a sequence (stop strings)."""
        self.check_request(prompts, max_new_tokens)
        sampler = Sampler(sampling)
        backend, cfg = self.backend, self.cfg
        dev = backend.device
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        capacity = longest + max_new_tokens
        pad = torch.tensor([longest - len(p) for p in prompts])
        tokens = torch.zeros(b, longest, dtype=torch.int64)
        for i, p in enumerate(prompts):
            tokens[i, pad[i]:] = torch.tensor(p)

        caches = [torch.zeros(b, capacity, cfg.latent_dim, dtype=backend.act_dtype, device=dev)
                  for _ in range(cfg.num_hidden_layers)]
        slots = torch.arange(capacity).expand(b, capacity)
        results = [Result(list(p)) for p in prompts]
        done = torch.zeros(b, dtype=torch.bool)
        timings = Timings()
        sessions_at_start = getattr(backend, "session_seconds", None)

        def step(step_ids: torch.Tensor, filled: int) -> torch.Tensor:
            """Run step_ids [b, t] at cache slots filled..filled+t; returns the last position's logits."""
            t = step_ids.shape[1]
            new_slots = torch.arange(filled, filled + t).expand(b, t)
            q_pos = (new_slots - pad[:, None]).clamp(min=0)
            # keys: every cache slot (valid if written and not padding), then the t new positions
            key_pos = torch.cat([slots, new_slots], dim=1) - pad[:, None]
            key_valid = torch.cat([(slots < filled), torch.ones(b, t, dtype=torch.bool)], dim=1) & (key_pos >= 0)
            mask = attention_mask(q_pos, key_pos, key_valid).to(dev)
            cos, sin = (x.to(dev, backend.act_dtype) for x in rope_tables(cfg, q_pos))
            return self._forward(step_ids.to(dev), cos, sin, mask, caches, filled, timings)[:, -1]

        # prefill in chunks: the mask and the scores of a step grow with t x (capacity + t)
        t0 = time.perf_counter()
        for start in range(0, longest, self.prefill_chunk):
            logits = step(tokens[:, start:start + self.prefill_chunk], start)
        filled = longest
        timings.prefill_tokens = b * longest
        while True:
            nxt = sampler(logits)
            for i in range(b):
                if done[i]:
                    continue
                tok = int(nxt[i])
                res = results[i]
                res.token_ids.append(tok)
                if on_token:
                    on_token(i, tok)
                if tok in self.stop_ids:
                    res.finish_reason, done[i] = "stop_token", True
                elif stop_check is not None and stop_check(i, res.token_ids):
                    res.finish_reason, done[i] = "stop_string", True
                elif len(res.token_ids) >= max_new_tokens:
                    done[i] = True
            dt = time.perf_counter() - t0
            if timings.prefill_s == 0:
                timings.prefill_s = dt  # the prompt's steps and the first token's choice
            else:
                timings.decode_s += dt
                timings.decode_steps += 1
                timings.decode_tokens += b
            if sessions_at_start is not None:
                timings.session_s = backend.session_seconds - sessions_at_start
            if bool(done.all()):
                return results, timings
            t0 = time.perf_counter()
            logits = step(nxt.view(b, 1), filled)
            filled += 1

    def _forward(self, ids, cos, sin, mask, caches, filled, timings: Timings) -> torch.Tensor:
        backend, clock = self.backend, time.perf_counter
        t = ids.shape[1]
        t0 = clock()
        h = backend.embed(ids)
        inside = clock() - t0
        for layer, cache in enumerate(caches):
            t0 = clock()
            h, new = backend.block(layer, h, cos, sin, mask, cache)
            inside += clock() - t0
            cache[:, filled:filled + t] = new  # in place: the only write to the cache this step
        last = h[:, -1:].contiguous()
        t0 = clock()
        logits = backend.head(last)
        timings.backend_s += inside + clock() - t0
        return logits
