"""What generate and chat write to the terminal: a sequence's text as it streams, a chat answer split into thinking
(dimmed on a terminal, or hidden), content and tool calls, and one line of prefill progress for a long prompt."""

from __future__ import annotations

import sys

from k2trt.runtime.entrypoints.model import progress_line
from k2trt.runtime.text.chat_output import ChatOutputParser


class StreamPrinter:
    """Writes a sequence's text to the terminal as it comes (Generator.generate's on_text): what its TextStream
    lets it show, so a stop string is cut before any of it is shown, a UTF-8 character is never split and stop
    tokens are never shown."""

    def __init__(self, out=None):
        self.out = out or sys.stdout  # the stdout of now, not of import

    def __call__(self, seq: int, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def finish(self) -> None:
        self(0, "\n")


DIM, UNDIM = "\033[2m", "\033[22m"



class ChatPrinter(StreamPrinter):
    """A chat answer as it comes, split by its parser: thinking dimmed on a terminal (plain elsewhere) or hidden,
    then the content, each tool call on a line of its own when it is complete."""

    def __init__(self, parser: ChatOutputParser, hide_thinking: bool = False, out=None):
        super().__init__(out)
        self.parser, self.hide = parser, hide_thinking
        self.dim = self.out.isatty()
        self.thinking = False

    def _show(self, delta) -> None:
        if delta.reasoning and not self.hide:
            if self.dim and not self.thinking:
                self.out.write(DIM)
            self.thinking = True
            self.out.write(delta.reasoning)
        if (delta.content or delta.calls) and self.thinking:
            self.out.write((UNDIM if self.dim else "") + "\n")
            self.thinking = False
        self.out.write(delta.content)
        for call in delta.calls:
            if call.id is not None:
                self.out.write(f"\n[tool call {call.id}] ")
            self.out.write(call.arguments)
        self.out.flush()

    def __call__(self, seq: int, text: str) -> None:
        self._show(self.parser.feed(text))

    def finish(self) -> None:
        self._show(self.parser.finish())
        self.out.write((UNDIM if self.dim and self.thinking else "") + "\n")
        self.out.flush()



class PrefillProgress:
    """on_prefill for the generator: for prompts of more than a few chunks, one line on the terminal, rewritten
    after each chunk, with the prompt tokens fed so far (all prompts together)."""

    CHUNKS = 4  # prompts up to this many chunks finish too soon to need a line

    def __init__(self, prompts: list[list[int]], chunk: int, prefix: str = "k2trt generate", stream=None):
        self.total = sum(len(p) for p in prompts)
        self.fed: dict[int, int] = {}
        long = max(len(p) for p in prompts) > self.CHUNKS * chunk
        self.show = progress_line(prefix, "prefill", stream) if long else None

    def __call__(self, request) -> None:
        if self.show is None:
            return
        self.fed[request.id] = request.fed
        done = sum(self.fed.values())
        self.show(done, self.total, f"{100 * done // self.total}% of the prompt tokens")
