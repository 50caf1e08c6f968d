"""K2-format answers split into thinking, content and tool calls (runtime/text/chat_output.py), as vLLM's and
SGLang's kimi_k2 parsers read them: several calls, arguments with braces and quotes inside strings, ids with and
without `functions.`, malformed calls kept as content, output cut inside a call (the call dropped, no K2 markup
in content, streamed or not), and the same result whether the text comes whole, in any two pieces or one
character at a time."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k2trt.runtime.text.chat_output import (ChatOutputParser, ToolCall, answer_parser, chat_parser, split_answer,
                                            template_thinks)
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


def test_truncated_output_keeps_the_complete_calls_and_drops_the_cut_one():
    first = call("functions.search:0", '{"q": "x"}')
    cut = CB + "functions.get_time:1" + AB + '{"tz": "U'
    p, streamed = parse(f"Hi{SB}{first}{cut}")
    assert p.tool_calls == [ToolCall("functions.search:0", "search", '{"q": "x"}')] == as_calls(streamed)
    assert p.content == "Hi" and streamed["content"] == p.content
    p, streamed = parse(f"Hi{SB}{CB}functions.sea")  # cut inside the id
    assert p.tool_calls == [] and p.content == "Hi" == streamed["content"] and streamed["calls"] == {}


# ---- cut inside a tool call (issue 41): the calls closed become tool calls, an unclosed one is dropped ------------

ROUTE = frozenset({"route"})
CUT = f'{CB}functions.route:592{AB}{{"n": 1}}'  # tool_choice "required" under max_tokens 20, as it was answered
CLOSED = call("functions.route:0", '{"n": 1}')
ROUTE_CALL = ToolCall("functions.route:0", "route", '{"n": 1}')
# (text, thinks, reasoning, content, calls): every text ends inside a call or a section, or has markers out of place
CUTS = {
    "a call cut, no section": (CUT, False, "", "", []),
    "a call cut in its section": (SB + CUT, False, "", "", []),
    "cut after the argument marker": (f"{SB}{CB}functions.route:592{AB}", False, "", "", []),
    "cut in the id": (f"{SB}{CB}functions.ro", False, "", "", []),
    "cut in a marker": (f"{SB}{CB}functions.route:592<|tool_call_argu", False, "", "", []),
    "cut right after the section began": (f"Sure.{SB}", False, "", "Sure.", []),
    "the first closed, the second cut": (SB + CLOSED + CB + "functions.route:1" + AB + '{"n": 2', False, "", "",
                                         [ROUTE_CALL]),
    "the first closed, cut before the second": (f"Hi {SB}{CLOSED}\n", False, "", "Hi ", [ROUTE_CALL]),
    "the section never ended, text after a call": (f"{SB}{CLOSED} and then", False, "", " and then", [ROUTE_CALL]),
    "a call never closed before the next": (SB + CUT + CLOSED + SE + "ok", False, "", "ok", [ROUTE_CALL]),
    "a call never closed before the section end": (SB + CUT + SE + " ok", False, "", " ok", []),
    "thinking, then a cut call": (f"<think>go{SB}{CUT}", True, "go", "", []),
    "thinking, then a bare cut call": (f"go</think>x{CUT}", True, "go", "x", []),
    "markers out of place": (f"a{CE}b{AB}c{SE}d{SB}{SB}{AB}{CE}{CLOSED}{SE}", False, "", "abcd", [ROUTE_CALL]),
}


def streamed_message(text: str, pieces: list[str], thinks: bool) -> tuple[dict, list]:
    """The message a stream of `pieces` joins to (as serve's client and ChatPrinter see it), and its deltas."""
    p = answer_parser(thinks, ROUTE)
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls and c.arguments == ""  # the name first, once
                calls[c.index] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            calls[c.index]["function"]["arguments"] += c.arguments
    content = "".join(d.content for d in deltas)
    out = {"content": content or (None if calls else "")}
    if thinks:
        out["reasoning_content"] = "".join(d.reasoning for d in deltas) or None
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out, deltas


def expected(thinks, reasoning, content, calls) -> dict:
    out = {"content": content or (None if calls else "")}
    if thinks:
        out["reasoning_content"] = reasoning or None
    if calls:
        out["tool_calls"] = [c.as_openai() for c in calls]
    return out


@pytest.mark.parametrize("name", CUTS)
def test_a_cut_call_is_dropped_and_no_markup_reaches_content(name):
    text, thinks, reasoning, content, calls = CUTS[name]
    whole = split_answer(answer_parser(thinks, ROUTE), text)
    assert whole == expected(thinks, reasoning, content, calls)
    assert "<|" not in (whole["content"] or "") and "<|" not in (whole.get("reasoning_content") or "")


def test_the_issues_answer():
    """tool_choice "required" cut by max_tokens: no markup in content, no tool call; a closed first call is one."""
    assert split_answer(answer_parser(False, ROUTE), CUT) == {"content": ""}
    second = SB + CLOSED + f'{CB}functions.route:1{AB}{{"n": 2}}'
    assert split_answer(answer_parser(False, ROUTE), second) == {"content": None,
                                                                  "tool_calls": [ROUTE_CALL.as_openai()]}


@pytest.mark.parametrize("name", CUTS)
def test_streamed_cut_answers_join_to_the_whole_split(name):
    """Every two-piece split and one character at a time: the deltas join to exactly the whole answer, and no delta
    sends any piece of a marker (the stream holds back what may begin one)."""
    text, thinks, *_ = CUTS[name]
    whole = split_answer(answer_parser(thinks, ROUTE), text)
    splits = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for pieces in splits:
        joined, deltas = streamed_message(text, pieces, thinks)
        assert joined == whole, pieces
        for d in deltas:
            assert "<|" not in d.content and "<|" not in d.reasoning, (pieces, d)


def test_a_bare_call_outside_a_section_is_a_call():
    """A `<|tool_call_begin|>` with no section begun opens one (the model skipped the section's marker)."""
    text = "Let me route." + CLOSED + " done"
    assert split_answer(answer_parser(False, ROUTE), text) == {"content": "Let me route. done",
                                                               "tool_calls": [ROUTE_CALL.as_openai()]}
    for pieces in [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]:
        assert streamed_message(text, pieces, False)[0] == split_answer(answer_parser(False, ROUTE), text)


def test_one_parser_for_every_caller():
    """answer_parser (serve's AnswerShape, generate, chat): None where the text is all content; split_answer gives
    the message fields serve returns — reasoning_content only for a template that thinks."""
    assert answer_parser(False, None) is None
    assert split_answer(None, f"x{SB}") == {"content": f"x{SB}"}
    assert split_answer(answer_parser(True, None), "a</think>b") == {"content": "b", "reasoning_content": "a"}
    assert split_answer(answer_parser(False, ROUTE), "b") == {"content": "b"}
    one = SB + CLOSED + call("functions.route:1", "{}") + SE
    assert split_answer(answer_parser(False, ROUTE, max_calls=1), one) == {
        "content": call("functions.route:1", "{}"), "tool_calls": [ROUTE_CALL.as_openai()]}

    class Tok:
        def __init__(self, thinks):
            self.thinks = thinks

        def has_token(self, name):
            return self.thinks and name == "</think>"

    assert chat_parser(Tok(False), None) is None and template_thinks(Tok(True))
    tools = [{"type": "function", "function": {"name": "route"}}]
    assert split_answer(chat_parser(Tok(False), tools), CUT) == {"content": ""}
    assert split_answer(chat_parser(Tok(True), tools), f"hm{CUT}") == {"content": "", "reasoning_content": "hm"}
    assert chat_parser(Tok(True), None, {"thinking": False}) is None


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
    text = ANSWERS["several calls, braces and quotes in strings"][0] + "tail" + SB + call("functions.search:2", "{}") \
        + CUT
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
