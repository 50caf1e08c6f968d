"""Speculative decoding: a request proposes k draft tokens, the target checks them all in one step, and every draft
up to the first the target would not have chosen is kept — several tokens for one step's reading of the weights.

`--speculative-config` takes vLLM's JSON (`{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
"prompt_lookup_min": M}`, or `{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}`: an EAGLE-3 draft,
runtime/generation/eagle.py). Prompt lookup (`ngram`) needs no weights: the longest run of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) found earlier in its prompt and output proposes the tokens that
followed it there — it pays where the output copies the input (an agent re-sending a file it edits) or repeats
itself.

Exact, sampled too: a draft is one token (a one-hot proposal q), so the rejection rule "accept x with probability
min(1, p(x)/q(x)), else draw from max(p − q, 0)" is the same as drawing y from p and keeping the draft when y == x,
emitting y either way. The verify step draws each position's token with the request's own sampler, in order, one
draw per emitted token, and stops at the first that differs from the draft: the tokens are the ones decoding
without speculation draws, seeded ones included (executor.StageExecutor.sample).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import numpy as np

from k2trt.errors import K2Error
from k2trt.draft_config import MAX_SPECULATIVE_TOKENS  # the bound on k: one definition, the drafts read it too

METHODS = ("ngram", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: draft tokens proposed per step
    prompt_lookup_max: int = 4  # the longest suffix looked up
    prompt_lookup_min: int = 1  # the shortest
    model: str | None = None  # eagle3: the draft checkpoint, a directory or owner/name (k2trt/draft.py)
    # whether num_speculative_tokens was given: if not, a draft that names its own k gets it (vLLM's rule)
    num_speculative_tokens_given: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise K2Error(f"--speculative-config: method {self.method!r} is not supported (supported: "
                          f"{', '.join(METHODS)})")
        if (self.method == "eagle3") != (self.model is not None):
            raise K2Error("--speculative-config: \"model\" (the draft) goes with method eagle3, and only with it")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise K2Error(f"--speculative-config: num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got "
                          f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise K2Error("--speculative-config: needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                          f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        """vLLM's --speculative-config JSON; an unknown key or a wrong type is one line."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise K2Error(f"--speculative-config is not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise K2Error("--speculative-config must be a JSON object, e.g. "
                          '{"method": "ngram", "num_speculative_tokens": 3}')
        known = {"method": str, "num_speculative_tokens": int, "prompt_lookup_max": int, "prompt_lookup_min": int,
                 "model": str}
        for key, value in d.items():
            if key not in known:
                raise K2Error(f"--speculative-config: unknown key {key!r} (known: {', '.join(known)})")
            if not isinstance(value, known[key]) or isinstance(value, bool):
                kind = "a string" if known[key] is str else "an integer"
                raise K2Error(f"--speculative-config: {key} must be {kind}")
        return cls(**d, num_speculative_tokens_given="num_speculative_tokens" in d)

    def propose(self, tokens: list[int], most: int) -> list[int]:
        """At most `most` (<= k) draft tokens for a sequence whose tokens so far are `tokens`."""
        return ngram_proposal(tokens, min(most, self.num_speculative_tokens), self.prompt_lookup_min,
                              self.prompt_lookup_max)


MAX_BACKOFF_STEPS = 32


@dataclass
class DraftBackoff:
    """A request's policy: after a verify step that kept no draft, it proposes nothing for 1, 2, 4, ... (at most
    MAX_BACKOFF_STEPS) decode steps; a kept draft resets it. A draft nobody accepts widens its step for nothing
    (every row of a step computes as many positions as its widest), so a request whose text stopped repeating stops
    asking."""
    misses: int = 0
    wait: int = 0

    def ready(self) -> bool:
        if self.wait:
            self.wait -= 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.wait = min(MAX_BACKOFF_STEPS, 2 ** (self.misses - 1))


def ngram_proposal(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of n_max down to
    n_min tokens (fewer where the sequence ends sooner); none where no suffix occurs earlier. Vectorized: a
    request's whole history is searched at every step."""
    if k < 1 or len(tokens) < 2:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        # every window of n tokens that starts early enough to have a token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if starts.size:  # the latest: what followed it last is the likeliest to follow again
            start = int(starts[-1])
            return tokens[start + n:start + n + k]
    return []


@dataclass
class SpecCounters:
    """What speculation did, for /metrics and `generate --json`, as vLLM counts it: steps with drafts, draft
    tokens proposed, drafts accepted, and the accepted drafts at each draft position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def add(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        per = self.accepted_per_pos or []
        per += [0] * (proposed - len(per))
        for i in range(accepted):
            per[i] += 1
        self.accepted_per_pos = per

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        """Two schedulers' counters together (micro-batch lanes): the per-position counts added position by
        position."""
        mine, theirs = self.accepted_per_pos or [], other.accepted_per_pos or []
        per = [a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)]
        return SpecCounters(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                            self.num_accepted_tokens + other.num_accepted_tokens, per or None)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify step: the accepted drafts and the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class SpeedPolicy:
    """Whether speculating pays here, measured: the tokens per second of decode steps with drafts against those
    without (moving averages), so speculation pauses where verifying k drafts costs more than the drafts kept give
    back — on a device where a step's cost follows its positions (a CPU, a large batch) rather than the weights it
    reads — and resumes to check again. The first WARMUP steps run without drafts to measure the plain rate."""
    plain_rate: float | None = None
    spec_rate: float | None = None
    pause: int = 0  # decode steps left without drafts
    WARMUP = 4
    PAUSE_STEPS = 64  # plain steps between two trials of speculation once it lost
    SMOOTHING = 0.3  # weight of the newest step in each average

    def __post_init__(self):
        self.pause = self.WARMUP

    def allow(self) -> bool:
        """Called once per decode step: may its requests propose drafts?"""
        if self.pause:
            self.pause -= 1
            return False
        return True

    def observe(self, seconds: float, tokens: int, speculated: bool) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        if speculated:
            self.spec_rate = rate if self.spec_rate is None else \
                self.spec_rate + self.SMOOTHING * (rate - self.spec_rate)
            if self.plain_rate is not None and self.spec_rate < self.plain_rate:
                self.pause = self.PAUSE_STEPS
        else:
            self.plain_rate = rate if self.plain_rate is None else \
                self.plain_rate + self.SMOOTHING * (rate - self.plain_rate)


@dataclass
class DraftLength:
    """How many drafts a step proposes, measured: the rate at which draft position i is kept (a moving average over
    verify steps that proposed it), and k the longest run of positions from the first whose rates stay at least
    MIN_RATE — a position seldom kept only widens every verify row (each computes as many positions as its widest).
    Every PROBE_STEPS steps one step proposes the configured k again, so a rate that recovered is seen."""
    rates: list[float] = field(default_factory=list)  # per draft position; a new one starts at 1 (optimistic)
    steps: int = 0
    MIN_RATE = 0.1
    SMOOTHING = 0.1
    PROBE_STEPS = 32

    def k(self, most: int) -> int:
        """The drafts to propose this step, at most `most` (the configured num_speculative_tokens)."""
        self.steps += 1
        if self.steps % self.PROBE_STEPS == 0:
            return most
        k = 0
        while k < most and (k >= len(self.rates) or self.rates[k] >= self.MIN_RATE):
            k += 1
        return max(k, 1)

    def observe(self, proposed: int, kept: int) -> None:
        """One verify row: `proposed` drafts, the first `kept` of them kept."""
        self.rates += [1.0] * (proposed - len(self.rates))
        for i in range(proposed):
            self.rates[i] += self.SMOOTHING * (float(i < kept) - self.rates[i])
