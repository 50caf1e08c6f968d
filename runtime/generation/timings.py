"""Where a generation's time went: prefill and decode steps (wall time and tokens), and how much of it was spent
inside the backend's calls and inside its inference sessions — the rest is the runtime's host work."""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.runtime.generation.step import PREFILL


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens fed
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens sampled by decode steps
    backend_s: float = 0.0  # inside the backend's embed/block/head calls
    session_s: float | None = None  # inside the inference sessions, for backends that report it

    def add_step(self, kind: str, seconds: float, tokens: int) -> None:
        if kind == PREFILL:
            self.prefill_s += seconds
            self.prefill_tokens += tokens
        else:
            self.decode_s += seconds
            self.decode_steps += 1
            self.decode_tokens += tokens

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


class TimingProbe:
    """Reads the backend-time and session-time counters of an executor at the start of a measurement, and gives
    the differences at its end."""

    def __init__(self, executor):
        self.executor = executor
        self.backend0 = executor.clock.backend_s
        self.session0 = executor.session_seconds()

    def finish(self, t: Timings) -> Timings:
        t.backend_s = self.executor.clock.backend_s - self.backend0
        now = self.executor.session_seconds()
        t.session_s = None if now is None or self.session0 is None else now - self.session0
        return t
