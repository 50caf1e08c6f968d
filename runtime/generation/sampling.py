"""Token choice from logits: greedy, temperature, top-k, top-p, seeded.

Each sequence has its own Sampler and random stream, seeded by its request: its tokens do not depend on what else
is in the batch. Sampling draws one uniform number per step and inverts the CDF, so two backends whose logits
agree to within rounding pick the same token for the same seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k2trt.args import MAX_SEED
from k2trt.errors import K2Error


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise K2Error(f"--temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise K2Error(f"--top-k must be >= 0, got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise K2Error(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise K2Error(f"--seed must be in 0..{MAX_SEED}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64, one uniform draw per row, rows in order."""
        p = self.params
        logits = logits.float().cpu()
        if p.greedy:
            return logits.argmax(dim=-1)
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        u = torch.rand(probs.shape[0], 1, generator=self.gen)
        cdf = probs.cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1).clamp(max=probs.shape[-1] - 1)
