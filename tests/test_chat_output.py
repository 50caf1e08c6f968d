"""K2-format answers split into thinking, content and tool calls (runtime/text/chat_output.py), as vLLM's and
SGLang's kimi_k2 parsers read them: several calls, arguments with braces and quotes inside strings, ids with and
without `functions.`, truncated output, malformed calls kept as content, and the same result whether the text
comes whole or one character at a time."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k2trt.runtime.text.chat_output import ChatOutputParser, ToolCall
from k2trt.runtime.text.markers import MarkerScanner

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOOLS = frozenset({"get_weather", "search", "get_time"})


def call(id_: str, args: str) -> str:
    return f"{CB}{id_}{AB}{args}{CE}"


def parse(text: str, pieces=None, **kw):
    """The parser fed `pieces` (default: the whole text), and what its deltas add up to."""
    p = ChatOutputParser(**{"tool_names": TOOLS, **kw})
    deltas = [p.feed(x) for x in (pieces if pieces is not None else [text])] + [p.finish()]
    streamed = {"reasoning": "".join(d.reasoning for d in deltas), "content": "".join(d.content for d in deltas),
                "calls": {}}
    for d in deltas:
        for c in d.calls:
            e = streamed["calls"].setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert e["id"] is None and c.arguments == ""  # the name comes first, once
                e["id"], e["name"] = c.id, c.name
            e["arguments"] += c.arguments
    return p, streamed


def as_calls(streamed) -> list[ToolCall]:
    return [ToolCall(e["id"], e["name"], e["arguments"]) for _, e in sorted(streamed["calls"].items())]


PARIS = '{"city": "Paris"}'
TRICKY = '{"q": "a } b { \\"c\\" <d>"}'  # braces and escaped quotes inside a string
ANSWERS = {
    "one call": ("Let me look." + SB + call("functions.get_weather:0", PARIS) + SE,
                 "Let me look.", [ToolCall("functions.get_weather:0", "get_weather", PARIS)]),
    "several calls, braces and quotes in strings": (
        SB + call("functions.search:0", TRICKY) + call("functions.get_time:1", ' {"tz": "UTC"} ') + SE,
        "", [ToolCall("functions.search:0", "search", TRICKY), ToolCall("functions.get_time:1", "get_time",
                                                                       '{"tz": "UTC"}')]),
    "an id without functions.": (SB + call("get_time:3", "{}") + SE + "after",
                                 "after", [ToolCall("get_time:3", "get_time", "{}")]),
    "no tool call": ("just words, <|not a marker|>", "just words, <|not a marker|>", []),
}


@pytest.mark.parametrize("name", ANSWERS)
def test_answers_parse_into_openai_calls_whole_and_streamed(name):
    text, content, calls = ANSWERS[name]
    whole, streamed = parse(text)
    assert whole.content == content and whole.tool_calls == calls
    assert streamed["content"] == content and as_calls(streamed) == calls
    by_char, streamed_chars = parse(text, list(text))  # a marker split across deltas is still found
    assert by_char.content == content and by_char.tool_calls == calls and as_calls(streamed_chars) == calls
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("text, kept", [
    (f"{SB}{call('functions.nope:0', '{}')}{SE}", call("functions.nope:0", "{}")),  # not a declared function
    (f"{SB}{call('functions.search:0', '{not json')}{SE}", call("functions.search:0", "{not json")),
    (f"{SB}{call('functions.search:0', '[1, 2]')}{SE}", call("functions.search:0", "[1, 2]")),  # not an object
    (f"{SB}{call('search', '{}')}{SE}", call("search", "{}")),  # no :IDX
    (f"{SB}{CB}functions.search:0{CE}{SE}", f"{CB}functions.search:0{CE}"),  # no arguments
])
def test_a_malformed_call_is_content(text, kept):
    p, streamed = parse(text)
    assert p.tool_calls == [] and p.content == kept and streamed["content"] == kept


def test_truncated_output_keeps_the_complete_calls_and_returns_the_cut_one_as_content():
    first = call("functions.search:0", '{"q": "x"}')
    cut = CB + "functions.get_time:1" + AB + '{"tz": "U'
    p, streamed = parse(f"Hi{SB}{first}{cut}")
    assert p.tool_calls == [ToolCall("functions.search:0", "search", '{"q": "x"}')]
    assert p.content == "Hi" + cut and streamed["content"] == p.content
    p, _ = parse(f"Hi{SB}{CB}functions.sea")  # cut inside the id
    assert p.tool_calls == [] and p.content == f"Hi{CB}functions.sea"


def test_one_call_at_most_without_parallel_calls():
    text = SB + call("functions.search:0", "{}") + call("functions.get_time:1", "{}") + SE
    p, _ = parse(text, max_calls=1)
    assert [c.name for c in p.tool_calls] == ["search"] and p.content == call("functions.get_time:1", "{}")


def test_markers_are_text_when_tools_are_off():
    text = f"x{SB}{call('functions.search:0', '{}')}{SE}"
    p, _ = parse(text, tool_names=None)
    assert p.content == text and p.tool_calls == []


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>let me see</think>The answer.", "let me see", "The answer."),
    ("let me see</think>The answer.", "let me see", "The answer."),  # K2.5's prompt opened <think>
    ("still thinking when it ended", "still thinking when it ended", ""),
    ("a <think> inside</think>b", "a <think> inside", "b"),  # only a leading <think> is the marker
])
def test_reasoning_split(text, reasoning, content):
    for pieces in ([text], list(text)):
        p, streamed = parse(text, pieces, reasoning=True, tool_names=None)
        assert (p.reasoning, p.content) == (reasoning, content)
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, content)


def test_a_tool_call_section_ends_the_reasoning():
    text = f"<think>I should call{SB}{call('functions.search:0', '{}')}{SE}"
    p, _ = parse(text, reasoning=True)
    assert p.reasoning == "I should call" and p.content == ""
    assert p.tool_calls == [ToolCall("functions.search:0", "search", "{}")]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_of_the_text_gives_the_same_answer(data):
    text = ANSWERS["several calls, braces and quotes in strings"][0] + "tail"
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, _ = parse(text)
    split, streamed = parse(text, pieces)
    assert (split.content, split.tool_calls) == (whole.content, whole.tool_calls)
    assert as_calls(streamed) == whole.tool_calls


def test_the_marker_scanner_holds_only_a_possible_marker_start():
    s = MarkerScanner(("<think>", "</think>"))
    assert s.feed("ab</th") == [("ab", None)]
    assert s.feed("ink>c<") == [("", "</think>"), ("c", None)]
    assert s.flush() == "<"
