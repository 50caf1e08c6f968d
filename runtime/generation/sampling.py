"""Token choice from logits: greedy, temperature, top-k, top-p, seeded — the values (SamplingParams, checked
here once for the CLI, the server and the pipeline's messages), one sequence's sampler, and the rows of a step.

Each sequence has its own Sampler and random stream, seeded by its request: its tokens do not depend on what else
is in the batch. Sampling draws one uniform number per step and inverts the CDF, so two backends whose logits
agree to within rounding pick the same token for the same seed.

Degenerate values sample as their limit. A temperature so small that the logits divided by it overflow float32
(or that is 0 in float32) samples greedy, the limit as the temperature goes to 0; a top-p so small that it is 0
in float32 keeps only the most likely token, the limit as top-p goes to 0 — greedy too. Neither is ever the
NaN distribution float32 would otherwise give. A temperature so large that the scaled logits underflow gives
the uniform distribution, which is its limit as it is.

`sample_rows` is where a step's rows meet their samplers: the place where a per-sequence mask (a grammar) would
apply before the choice and where log-probabilities would be read after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from k2trt.args import MAX_SEED
from k2trt.errors import K2Error


# the largest value float32 rounds to 0: half its smallest subnormal (2**-149), which rounds to even, 0
FLOAT32_ZERO = 2.0 ** -150


class SamplingError(K2Error):
    """A sampling value out of range; `field` names it as SamplingParams (and the OpenAI API) spell it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (the rule, what it says when broken); the one statement of each value's range
_RULES = {
    "temperature": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "must be a finite number >= 0"),
    "top_k": (lambda v: _integer(v) and v >= 0, "must be an integer >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "must be in (0, 1]"),
    "seed": (lambda v: _integer(v) and 0 <= v <= MAX_SEED, f"must be an integer in 0..{MAX_SEED}"),
}


def field_problem(name: str, value) -> str | None:
    """What is wrong with `value` for the sampling field `name` ("must be ..., got ..."), or None."""
    ok, says = _RULES[name]
    return None if ok(value) else f"{says}, got {value!r}"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        for f in fields(self):
            problem = field_problem(f.name, getattr(self, f.name))
            if problem:
                raise SamplingError(f.name, problem)

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax, drawing nothing: temperature 0, or a top-p that is 0 in float32
        (a temperature that overflows only for some logits is decided per row, in Sampler)."""
        return self.temperature == 0 or self.top_p <= FLOAT32_ZERO


# The defaults, in one place: the commands' (greedy, seed 0) and the OpenAI API's, which samples at temperature
# 1 when a request names none (each request that names no seed gets a random one: serve/protocol.py).
DEFAULTS = SamplingParams()
API_DEFAULTS = SamplingParams(temperature=1.0)


class Sampler:
    """One sequence's choice of tokens, with its own seeded random stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64, one uniform draw per row, rows in order."""
        p = self.params
        logits = logits.float().cpu()
        if p.greedy:
            return logits.argmax(dim=-1)
        scaled = logits / p.temperature
        # a temperature float32 cannot divide by (it overflowed, or is 0 in float32): its limit, greedy
        overflowed = ~torch.isfinite(scaled).all(dim=-1)
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(-1, keepdim=True)
        u = torch.rand(probs.shape[0], 1, generator=self.gen)
        cdf = probs.cumsum(-1)
        picked = torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        return torch.where(overflowed, logits.argmax(dim=-1), picked) if overflowed.any() else picked


def sample_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """One token for each row of `logits` [R, V], row r chosen by samplers[r]. The greedy rows draw nothing: one
    argmax for all of them picks what each sampler would. The drawn rows go to the host in one copy (each sampler
    copying its own row would be a device sync each) and are drawn by their own samplers."""
    out: list[int] = [0] * len(samplers)
    greedy = [r for r, s in enumerate(samplers) if s.params.greedy]
    if greedy:
        rows = logits if len(greedy) == len(samplers) else logits[greedy]  # all greedy: no gather copy
        for r, tok in zip(greedy, rows.float().argmax(dim=-1).tolist()):
            out[r] = tok
    drawn = [r for r, s in enumerate(samplers) if not s.params.greedy]
    if drawn:
        host = logits[drawn].float().cpu()
        for k, r in enumerate(drawn):
            out[r] = int(samplers[r](host[k:k + 1])[0])
    return out
