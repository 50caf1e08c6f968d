"""What ends a sequence and the text it shows: one path for `k2trt generate`, `k2trt chat` and the server.

`StopRules` is built once — per command (generate, chat) or per request body (serve) — from the tokenizer, the
stop strings and the stop ids. A request holds it (runtime/generation/scheduler.Request): the scheduler ends the
request at one of its stop ids, and gives each sequence its own `TextStream` (`rules.stream()`), which it feeds
every kept token, once:

- `feed(token)` decodes it and returns the text that can be shown now: a UTF-8 character split across tokens is
  held until complete, and just enough characters are held back that a stop string is cut before any of it is
  shown; stop tokens are never shown;
- `stopped` once a stop string has appeared: the scheduler ends the request (finish reason "stop_string");
- `finish()` returns what was still held, and `text` is then the sequence's whole text, cut at the stop string:
  what a terminal showed, what chat keeps in its history, what the server answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.errors import K2Error


@dataclass(frozen=True)
class StopRules:
    """A request's stop conditions. Without a tokenizer (benchmarks, tools that compare token ids) there is no
    text and no stop string, only stop ids."""

    ids: frozenset[int] = frozenset()  # tokens that end the sequence
    strings: tuple[str, ...] = ()  # text that ends it (cut before it is shown)
    hidden: frozenset[int] = frozenset()  # tokens never shown: every stop token, also those ignore_eos runs past
    tokenizer: object = None

    @classmethod
    def of(cls, tokenizer, strings=(), stop_ids=(), ignore_eos: bool = False) -> "StopRules":
        """The model's stop tokens (the tokenizer's: [EOS], <|im_end|>), unless ignore_eos, and the caller's stop
        ids and strings; an id past the vocabulary is refused (no token could ever match it)."""
        model, own = frozenset(tokenizer.stop_ids), frozenset(stop_ids)
        outside = sorted(t for t in own if not 0 <= t < tokenizer.vocab_size)
        if outside:
            raise K2Error(f"stop token id {outside[0]} is outside the vocabulary (ids 0 to {tokenizer.vocab_size - 1})")
        return cls(ids=own if ignore_eos else own | model, strings=tuple(s for s in strings if s),
                   hidden=own | model, tokenizer=tokenizer)

    def stream(self) -> "TextStream | None":
        """A fresh text stream for one sequence (None without a tokenizer)."""
        return None if self.tokenizer is None else TextStream(self)


NO_STOPS = StopRules()


class TextStream:
    def __init__(self, rules: StopRules):
        self.rules = rules
        self.decoder = rules.tokenizer.stream_decoder()
        self.hold = max((len(s) for s in rules.strings), default=1) - 1
        self.pending = ""  # decoded, not shown yet: it may be the start of a stop string
        self.shown: list[str] = []
        self.stopped = self.finished = False

    def _show(self, text: str) -> str:
        if text:
            self.shown.append(text)
        return text

    def feed(self, token: int) -> str:
        if self.stopped or self.finished or token in self.rules.hidden:
            return ""
        self.pending += self.decoder.feed(token)
        hits = [self.pending.index(s) for s in self.rules.strings if s in self.pending]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return self._show(out)
        if len(self.pending) > self.hold:
            cut = len(self.pending) - self.hold
            out, self.pending = self.pending[:cut], self.pending[cut:]
            return self._show(out)
        return ""

    def finish(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD); after it, `text` is complete."""
        if self.stopped or self.finished:
            self.finished = True
            return ""
        self.finished = True
        rest = self.pending + self.decoder.flush()
        hits = [rest.index(s) for s in self.rules.strings if s in rest]  # a stop string the flush completed
        self.pending = ""
        return self._show(rest[:min(hits)] if hits else rest)

    @property
    def text(self) -> str:
        """Everything shown so far: the whole text, cut at the stop string, once finished."""
        return "".join(self.shown)
