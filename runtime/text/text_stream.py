"""Token ids to text, incrementally, with stop strings.

`TextStream.feed(id)` returns the text that can be shown now: a UTF-8 character split across tokens is held until
complete, and just enough characters are held back that a stop string can be cut before any of it is shown. Once a
stop string appears the stream is `stopped` and shows nothing more. `StopMatcher` is the same test for the
scheduler's thread: whether the text so far contains a stop string, checked on the new tail only. Both serve
`k2trt generate`, `k2trt chat` and the server.
"""

from __future__ import annotations


class StopMatcher:
    """stop_check for a Request: True once the decoded text contains one of the stop strings."""

    def __init__(self, tokenizer, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.decoder = tokenizer.stream_decoder()
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""  # the last keep characters: a stop string ending in the new piece starts no earlier

    def __call__(self, ids: list[int]) -> bool:
        window = self.tail + self.decoder.feed(ids[-1])
        self.tail = window[-self.keep:] if self.keep else ""
        return any(s in window for s in self.stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    ends = [text.index(s) for s in stops if s and s in text]
    return text[:min(ends)] if ends else text


class TextStream:
    def __init__(self, decoder, stops: list[str], skip_ids=()):
        self.decoder = decoder  # tokenizer.stream_decoder()
        self.stops = [s for s in stops if s]
        self.skip_ids = set(skip_ids)  # stop tokens: generated, never shown
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending, self.stopped = "", False

    def feed(self, token: int) -> str:
        if self.stopped or token in self.skip_ids:
            return ""
        self.pending += self.decoder.feed(token)
        hits = [self.pending.index(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        if len(self.pending) > self.hold:
            cut = len(self.pending) - self.hold
            out, self.pending = self.pending[:cut], self.pending[cut:]
            return out
        return ""

    def finish(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        out = cut_at_stop(self.pending + self.decoder.flush(), self.stops)
        self.pending = ""
        return out
