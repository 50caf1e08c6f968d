"""K2's output markers, and the one way text is scanned for them as it streams.

The markers are special tokens (they decode whole), but a model may also spell one in ordinary tokens; both read
the same here, as they do for vLLM's and SGLang's kimi_k2 parsers, which work on the decoded text too.
"""

from __future__ import annotations

THINK_BEGIN, THINK_END = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)


class MarkerScanner:
    """Text in, (text, marker) pieces out: the text before each marker it finds, then the marker. The end of what
    it has seen is held back while it could be the start of a marker, so a marker split across deltas is still
    found; `flush()` gives what is held."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self.pending = ""

    def feed(self, text: str) -> list[tuple[str, str | None]]:
        self.pending += text
        out: list[tuple[str, str | None]] = []
        while True:
            hits = [(self.pending.find(m), -len(m), m) for m in self.markers if m in self.pending]
            if not hits:
                break
            at, _, marker = min(hits)  # the first marker; the longest at the same place
            out.append((self.pending[:at], marker))
            self.pending = self.pending[at + len(marker):]
        keep = self._partial_suffix()
        if len(self.pending) > keep:
            out.append((self.pending[:len(self.pending) - keep], None))
            self.pending = self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _partial_suffix(self) -> int:
        """The length of the longest end of `pending` that begins some marker."""
        for n in range(min(len(self.pending), max(len(m) for m in self.markers) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(m.startswith(tail) for m in self.markers):
                return n
        return 0
