"""A chat answer's text split as K2 writes it: thinking, content and tool calls — fed as it streams, so the pieces
sent as it comes join to exactly what a whole answer gives (one parser, fed once or token by token). The one
splitter of serve (streamed and whole), generate and chat: `answer_parser` makes it, `split_answer` splits a
finished text into an assistant message's fields.

K2's format (vLLM's and SGLang's kimi_k2 tool and reasoning parsers read the same):

    [<think>]reasoning</think>content<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|> ...
    <|tool_calls_section_end|>content

- **Thinking** (templates that think: K2-Thinking, K2.5 unless `thinking` is off): the text from the start is
  reasoning, a leading <think> dropped (K2.5's prompt opens it, K2-Thinking's model writes it), until </think> or a
  tool call, which ends it too.
- **Tool calls** (when the request gives tools and tool_choice is not "none"): a call's id is `functions.NAME:IDX`
  (`NAME:IDX` is read too), which is also the OpenAI call id; its arguments are the text between the markers,
  stripped. A call is decided when `<|tool_call_end|>` closes it: one that names a declared function and whose
  arguments are a JSON object becomes a tool call — sent name first, then its arguments in the pieces they were
  generated in, only then, so a stream never sends a call the whole answer lacks — and any other (unknown name,
  arguments that are not JSON) goes back as content, its markers included, as vLLM answers a malformed call. With
  `max_calls` (OpenAI's parallel_tool_calls false: 1), closed calls past it are content too.
- **A call never closed** — cut by the end of the output (max_tokens), or followed by another call or the
  section's end instead of its `<|tool_call_end|>` — is dropped, as vLLM's kimi_k2 parser drops it: nothing of it
  is content or a call. A `<|tool_call_begin|>` outside a section opens one, as if the section had begun.
- **K2's tool-call markers are never content**: the section's markers, and any marker out of place, are dropped;
  only a malformed call (above) carries its markers into content. While the text streams, its end is held back
  while it could be the start of a marker (markers.MarkerScanner), so no delta sends a piece of one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from k2trt.runtime.text.markers import (ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_BEGIN,
                                        THINK_END, TOOL_MARKERS, MarkerScanner)

def template_thinks(tokenizer, template_kwargs: dict | None = None) -> bool:
    """A template that thinks: its tokenizer has </think> (K2-Thinking, K2.5), and thinking is not turned off
    (K2.5's {"thinking": false}), as vLLM's kimi_k2 reasoning parser decides."""
    return tokenizer.has_token(THINK_END) and (template_kwargs or {}).get("thinking", True) is not False


CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)")
REASONING, CONTENT, SECTION, CALL = "reasoning", "content", "section", "call"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDelta:
    """A piece of tool call `index`: its id and name first (arguments ""), then pieces of its arguments."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one piece of text adds."""
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class _Call:
    """A call being read: its raw text (for content, should it be malformed), id text and argument pieces."""

    def __init__(self):
        self.raw, self.id_text, self.pieces = CALL_BEGIN, "", []
        self.in_arguments = False

    def add(self, text: str) -> None:
        self.raw += text
        if self.in_arguments:
            self.pieces.append(text)
        else:
            self.id_text += text


class ChatOutputParser:
    def __init__(self, reasoning: bool = False, tool_names: Iterable[str] | None = None,
                 max_calls: int | None = None):
        """`reasoning`: the template thinks; `tool_names`: the functions a call may name (None: tools are off, the
        markers are text); `max_calls`: the most calls an answer makes (None: any number)."""
        self.thinks = reasoning
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.max_calls = max_calls
        markers = ((THINK_BEGIN, THINK_END) if reasoning else ()) + (TOOL_MARKERS if tool_names is not None else ())
        self.scanner = MarkerScanner(markers) if markers else None
        self.state = REASONING if reasoning else CONTENT
        self.started = False  # any text seen: a <think> only counts at the very start
        self.call: _Call | None = None
        self.blank = ""  # whitespace in a section, after its calls or stray text: content only if text follows
        self.reasoning, self.content, self.calls = "", "", []  # the whole answer so far

    # ---- feeding -----------------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self.scanner is None:
            self._text(text, delta)
            return delta
        for before, marker in self.scanner.feed(text):
            self._text(before, delta)
            if marker is not None:
                self._marker(marker, delta)
        return delta

    def finish(self) -> Delta:
        """The end of the output: what was held back (text, never a marker); a call still open is dropped."""
        delta = Delta()
        if self.scanner is not None:
            self._text(self.scanner.flush(), delta)
        self.call, self.blank = None, ""
        return delta

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.calls)

    def message(self) -> dict:
        """The answer's fields as the server returns an assistant message (after `finish`): content (None when
        the answer is only tool calls), reasoning_content where the template thinks (None when there is none),
        tool_calls where there are any."""
        out = {"content": self.content or (None if self.calls else "")}
        if self.thinks:
            out["reasoning_content"] = self.reasoning or None
        if self.calls:
            out["tool_calls"] = [c.as_openai() for c in self.calls]
        return out

    # ---- the states --------------------------------------------------------------------------------------
    def _text(self, text: str, delta: Delta) -> None:
        if not text:
            return
        self.started = True
        if self.state == REASONING:
            self._say(delta, reasoning=text)
        elif self.state == CALL:
            self.call.add(text)
        elif self.state == SECTION:  # stray text between calls is not lost; whitespace only before more of it
            text = self.blank + text
            said = text.rstrip()
            self._say(delta, content=said)
            self.blank = text[len(said):]
        else:
            self._say(delta, content=text)

    def _marker(self, marker: str, delta: Delta) -> None:
        state = self.state
        if state == CALL and marker not in (CALL_BEGIN, CALL_END, SECTION_END) and \
                not (marker == ARGUMENT_BEGIN and not self.call.in_arguments):
            self.call.add(marker)  # a marker out of place inside a call: the call's text (it will not be JSON)
        elif state == REASONING and marker == THINK_BEGIN and not self.started:
            pass
        elif state == REASONING and marker == THINK_END:
            self.state = CONTENT
        elif marker == SECTION_BEGIN and state in (REASONING, CONTENT):
            self.state = SECTION
        elif marker == CALL_BEGIN:  # in a section, or opening one; a call still open never ended: dropped
            self.call, self.blank, self.state = _Call(), "", CALL
        elif marker == ARGUMENT_BEGIN and state == CALL:  # the id read
            self.call.raw += marker
            self.call.in_arguments = True
        elif marker == CALL_END and state == CALL:
            self.call.raw += marker
            self._decide(delta)
            self.state = SECTION
        elif marker == SECTION_END and state in (SECTION, CALL):
            self.call, self.blank, self.state = None, "", CONTENT
        elif marker not in TOOL_MARKERS:  # a thinking marker out of place is text where it stands
            self._text(marker, delta)
        # else a tool-call marker out of place: dropped, never content
        self.started = True

    def _decide(self, delta: Delta) -> None:
        call, self.call = self.call, None
        match = CALL_ID.fullmatch(call.id_text.strip())
        arguments = "".join(call.pieces).strip()
        try:
            valid = (call.in_arguments and match is not None and match["name"] in self.tool_names
                     and (self.max_calls is None or len(self.calls) < self.max_calls)
                     and isinstance(json.loads(arguments), dict))
        except ValueError:
            valid = False
        if not valid:
            self._say(delta, content=call.raw)
            return
        index = len(self.calls)
        self.calls.append(ToolCall(call.id_text.strip(), match["name"], arguments))
        # a call's deltas are sent only now that it is closed and valid: a call cut off or malformed before its
        # end was never sent, so a stream joins to exactly the whole answer
        delta.calls.append(CallDelta(index, "", id=self.calls[-1].id, name=match["name"]))
        delta.calls += [CallDelta(index, p) for p in _strip_pieces(call.pieces) if p]

    def _say(self, delta: Delta, reasoning: str = "", content: str = "") -> None:
        delta.reasoning += reasoning
        delta.content += content
        self.reasoning += reasoning
        self.content += content


def answer_parser(reasoning: bool, tool_names: Iterable[str] | None = None,
                  max_calls: int | None = None) -> ChatOutputParser | None:
    """The splitter of one chat answer (serve, generate and chat all make theirs here): thinking where the template
    thinks, K2-format tool calls where `tool_names` is given (the declared functions; None: tools are off), at most
    `max_calls`. None where the text is all content."""
    if not reasoning and tool_names is None:
        return None
    return ChatOutputParser(reasoning=reasoning, tool_names=tool_names, max_calls=max_calls)


def chat_parser(tokenizer, tools: list | None = None,
                template_kwargs: dict | None = None) -> ChatOutputParser | None:
    """answer_parser for a conversation through `tokenizer`'s template, with OpenAI function `tools` (generate's
    --tools, chat's none)."""
    names = [t["function"]["name"] for t in tools] if tools else None
    return answer_parser(template_thinks(tokenizer, template_kwargs), names)


def split_answer(parser: ChatOutputParser | None, text: str) -> dict:
    """A finished chat answer's text as an assistant message's fields (ChatOutputParser.message): content,
    reasoning_content, tool_calls. `parser` is a fresh one from answer_parser (None: the text is all content)."""
    if parser is None:
        return {"content": text}
    parser.feed(text)
    parser.finish()
    return parser.message()


def _strip_pieces(pieces: list[str]) -> list[str]:
    """The pieces of a text, with the whitespace at both ends of the whole text taken off."""
    pieces = list(pieces)
    while pieces and not pieces[0].strip():
        pieces.pop(0)
    while pieces and not pieces[-1].strip():
        pieces.pop()
    if pieces:
        pieces[0] = pieces[0].lstrip()
        pieces[-1] = pieces[-1].rstrip()
    return pieces
