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

`sample_rows` is where a step's rows meet their samplers. A row decoded under a grammar (runtime/text/grammar.py)
has the tokens its grammar forbids masked to -inf before the choice, in its own row only, so the other rows of the
batch keep their tokens; its grammar then takes the token chosen. A row that asks for log-probabilities gets them
after the choice: the log-softmax, in float32, of the logits its sampler saw (its grammar's mask applied, before
temperature, top-k and top-p), for the chosen token and the most likely ones — so greedy's choice is always the
first of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from k2trt.args import MAX_SEED
from k2trt.errors import K2Error

MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound)


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
    "logprobs": (lambda v: v is None or (_integer(v) and 0 <= v <= MAX_LOGPROBS),
                 f"must be null or an integer in 0..{MAX_LOGPROBS}"),
    "prompt_logprobs": (lambda v: v is None or (_integer(v) and 0 <= v <= MAX_LOGPROBS),
                        f"must be null or an integer in 0..{MAX_LOGPROBS}"),
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
    logprobs: int | None = None  # the chosen token's log-probability and this many alternatives; None: none
    prompt_logprobs: int | None = None  # the same for every prompt token (from the prefill's logits); None: none

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


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely alternatives at its place, most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, V] (any dtype) and the n tokens chosen at those places -> their log-probabilities in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]


class Sampler:
    """One sequence's choice of tokens, with its own seeded random stream, its grammar's state (a matcher from
    runtime/text/grammar.py, or None) and the log-probabilities of its last choice (`chosen`) when it asks."""

    def __init__(self, params: SamplingParams, grammar=None):
        self.params = params
        self.gen = torch.Generator().manual_seed(params.seed)
        self.matcher = grammar.matcher() if grammar is not None else None
        self.chosen: TokenLogprob | None = None
        self.prompt_tail: torch.Tensor | None = None  # the last prompt chunk's last logits (prompt_logprobs)
        self.prompt_done = False  # its prompt's log-probabilities are all given

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> token ids [B] int64, one uniform draw per row, rows in order."""
        p = self.params
        logits = logits.float().cpu()
        if p.greedy:
            return logits.argmax(dim=-1)
        scaled = logits / p.temperature
        # a temperature float32 cannot divide by (it overflowed, or is 0 in float32): its limit, greedy; a token a
        # grammar masked (-inf) is no overflow
        overflowed = (~torch.isfinite(scaled) & torch.isfinite(logits)).any(dim=-1)
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
    """One token for each row of `logits` [R, V], row r chosen by samplers[r]. Rows under a grammar are masked
    first, each in place in its own row. The greedy rows draw nothing: one argmax for all of them picks what each
    sampler would. The drawn rows go to the host in one copy (each sampler copying its own row would be a device
    sync each) and are drawn by their own samplers. Then the rows that ask get their log-probabilities
    (Sampler.chosen) and the grammars take their tokens."""
    for r, s in enumerate(samplers):
        if s.matcher is not None:
            allowed = torch.from_numpy(s.matcher.allowed(logits.shape[-1])).to(logits.device)
            logits[r].masked_fill_(~allowed, float("-inf"))
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
    for r, s in enumerate(samplers):
        if s.params.logprobs is not None:
            s.chosen = logprobs_of(logits[r:r + 1], [out[r]], s.params.logprobs)[0]
        if s.matcher is not None:
            s.matcher.accept(out[r])
    return out
