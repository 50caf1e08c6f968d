"""Agents through the OpenAI API, with the official openai client against a live server on the tiny K2: forced
tool calls whose arguments validate against their schemas (random weights: the grammar guarantees it), streamed
calls equal to whole ones, a conversation with a tool result, json_schema and json_object answers, tool_choice
none, chat and echo log-probabilities, the reasoning split of a thinking template, concurrent requests under
grammars and not each equal to the same request alone, and every bad field a 400 naming it."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import jsonschema
import pytest

from servers import HANG_S, InProcessServer, Server, wait_until

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_ckpt, tiny_export):
    s = Server(tiny_ckpt, tiny_export, "--max-batch", "8", "--max-context", "1024")
    yield s
    assert s.stop() == 0, s.output()


def chat(server, **kw):
    return server.client.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 80, **kw})


def streamed(server, **kw) -> dict:
    """A streamed chat answer joined: content, reasoning, tool calls (name first, arguments in pieces), finish."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in server.client.chat.completions.create(model="tiny", stream=True,
                                                       **{"messages": ASK, "max_tokens": 80, **kw}):
        for c in chunk.choices:
            out["content"] += c.delta.content or ""
            out["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or []:
                e = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert e["id"] is None and tc.function.name  # the id and name come first, once
                    e["id"], e["name"] = tc.id, tc.function.name
                e["arguments"] += tc.function.arguments or ""
            out["finish"] = c.finish_reason or out["finish"]
    return out


# ---- tool calls ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_named_function_is_called_with_valid_arguments(server, seed):
    r = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
             temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("functions.get_weather:")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("seed", [4, 5])
def test_required_calls_some_tool_with_valid_arguments(server, seed):
    r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert r.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_equal_whole_ones(server):
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0.7, seed=9, max_tokens=200)
    whole = chat(server, **kw).choices[0]
    parts = streamed(server, **kw)
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in whole.message.tool_calls]
    assert [parts["calls"][i] for i in sorted(parts["calls"])] == calls
    assert parts["content"] == (whole.message.content or "") and parts["finish"] == whole.finish_reason


@pytest.mark.parametrize("max_tokens", [20, 50])
def test_a_forced_call_cut_by_max_tokens_is_dropped_and_leaves_no_markup(server, max_tokens):
    """tool_choice "required" cut by max_tokens (issue 41): the calls closed are tool calls, the one cut off is
    dropped, no K2 markup is content, finish_reason "length"; streamed the same. Greedy, the first call takes 25 to
    44 tokens here: 20 cuts it, 50 cuts the second."""
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=max_tokens)
    r = chat(server, **kw)
    whole = r.choices[0]
    assert whole.finish_reason == "length" and r.usage.completion_tokens == max_tokens
    assert "<|" not in (whole.message.content or "")
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in whole.message.tool_calls or []]
    assert len(calls) == (0 if max_tokens == 20 else 1)
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    parts = streamed(server, **kw)
    assert [parts["calls"][i] for i in sorted(parts["calls"])] == calls
    assert parts["content"] == (whole.message.content or "") and "<|" not in parts["content"]
    assert parts["finish"] == "length"


def test_a_conversation_with_a_tool_result(server):
    first = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 temperature=0).choices[0].message
    call = first.tool_calls[0]
    turns = ASK + [first.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    r = chat(server, messages=turns, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bare = chat(server, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools, the call and its result are there


def test_tool_choice_none_answers_in_text(server):
    r = chat(server, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > chat(server, max_tokens=1, temperature=0).usage.prompt_tokens  # declared


# ---- structured outputs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_answers_validate(server, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = chat(server, response_format=fmt, temperature=1.0, seed=seed)
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    assert r.choices[0].finish_reason == "stop"
    assert streamed(server, response_format=fmt, temperature=1.0, seed=seed)["content"] == \
        r.choices[0].message.content


def test_json_object_answers_are_objects(server):
    r = chat(server, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a free object from random weights may outrun max_tokens; what there is opens an object
        assert text.startswith("{")


# ---- log-probabilities ------------------------------------------------------------------------------------

def test_chat_logprobs(server):
    r = chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 3 for e in entries)
    for e in entries:  # greedy: the chosen token is the most likely, its value the first alternative's
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content
    chunks = [c for c in server.client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6,
                                                               temperature=0, logprobs=True, stream=True)]
    streamed_entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == \
        [(e.token, round(e.logprob, 4)) for e in entries]


def test_echo_logprobs_are_the_prefills_and_agree_with_generation(server, tiny_ckpt):
    """lm-eval's log-likelihood request: prompt + continuation, echo, logprobs, max_tokens 1. The prompt's
    log-probabilities come from the prefill and equal those the continuation's tokens had when they were
    generated (a chat's, whose entries carry each token's bytes, so its ids are known)."""
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(tiny_ckpt)
    gen = chat(server, max_tokens=4, temperature=0, logprobs=True).choices[0].logprobs.content
    prompt = tok.encode_chat(ASK)
    full = prompt + [tok._enc.encode_single_token(bytes(e.bytes)) for e in gen]
    echo = server.client.completions.create(model="tiny", prompt=full, max_tokens=1, temperature=0, echo=True,
                                            logprobs=2)
    e = echo.choices[0].logprobs
    assert len(e.tokens) == len(full) + 1 and e.token_logprobs[0] is None and e.top_logprobs[0] is None
    assert e.token_logprobs[len(prompt):len(full)] == pytest.approx([x.logprob for x in gen], abs=1e-4)
    assert all(1 <= len(t) <= 2 for t in e.top_logprobs[1:])  # keyed by text: two tokens may read alike
    assert echo.choices[0].text.startswith(tok.decode(full))
    assert e.text_offset[0] == 0 and e.text_offset == sorted(e.text_offset)


# ---- batching -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_requests_under_grammars_and_not_each_equal_alone(tiny_ckpt, tiny_export):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    asks = [dict(max_tokens=24, temperature=0),
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.8,
                 seed=3),
            dict(response_format=fmt, temperature=0),
            dict(max_tokens=20, temperature=0.9, seed=4, logprobs=True, top_logprobs=2)]

    def ask(s, kw):
        r = chat(s, **kw).choices[0]
        return r.message.model_dump(exclude_none=True), r.finish_reason, \
            [(e.token, round(e.logprob, 4)) for e in (r.logprobs.content if r.logprobs else [])]

    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "4", "--max-context", "1024") as s:
        alone = [ask(s, kw) for kw in asks]
        s.gate.batches.clear()
        s.gate.allow(2)  # the first's prefill and one decode step, then it waits
        with cf.ThreadPoolExecutor(len(asks)) as pool:
            first = pool.submit(ask, s, asks[0])
            s.gate.wait_held()
            rest = [pool.submit(ask, s, kw) for kw in asks[1:]]
            wait_until(lambda: s.scheduler_thread.waiting == len(rest), "the other requests to wait")
            s.gate.open()
            together = [first.result(HANG_S)] + [f.result(HANG_S) for f in rest]
        assert together == alone
        assert max(s.gate.batches) == len(asks)  # they decoded in the same steps


# ---- thinking ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_server(tiny_int4_ckpt, tiny_int4_export):
    s = Server(tiny_int4_ckpt, tiny_int4_export, "--max-context", "512")
    yield s
    assert s.stop() == 0, s.output()


@pytest.mark.slow
def test_a_thinking_template_answers_with_reasoning_content(thinking_server):
    # random weights never close the thinking: all of it is reasoning, as vLLM's kimi_k2 reasoning parser says
    r = chat(thinking_server, max_tokens=10, temperature=0).choices[0].message
    assert r.reasoning_content and not r.content
    assert streamed(thinking_server, max_tokens=10, temperature=0)["reasoning"] == r.reasoning_content
    off = chat(thinking_server, max_tokens=10, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert off.choices[0].message.content == r.reasoning_content  # thinking off: the same text is content


def test_chat_template_kwargs_reach_the_template(tiny_k25_ckpt, tmp_path):
    from k2trt.config import K2Config
    from k2trt.export.exporter import export

    export(K2Config.from_json(tiny_k25_ckpt), tmp_path / "onnx", "float32", log=lambda *a: None)
    with InProcessServer(tiny_k25_ckpt, tmp_path / "onnx", "--max-context", "256") as s:
        on = chat(s, max_tokens=1, temperature=0)
        off = chat(s, max_tokens=1, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
        assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1  # <think></think> instead of <think>
        assert off.choices[0].message.content is not None and on.choices[0].message.reasoning_content


# ---- bad input ------------------------------------------------------------------------------------------------

def _body(**kw):
    return {"model": "tiny", "messages": ASK, "max_tokens": 4, **kw}


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(2000)}}
BAD = [
    (_body(tools=[{"type": "retrieval"}]), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "frobnicate"}}}}}], tool_choice="required"), "tools"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": BIG}}], tool_choice="required"),
     "tools"),
    (_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nowhere"}}), "tool_choice"),
    (_body(tool_choice="required"), "tool_choice"),
    (_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (_body(top_logprobs=2), "top_logprobs"),
    (_body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}),
     "response_format"),
    (_body(response_format={"type": "yaml"}), "response_format"),
    (_body(messages=ASK + [{"role": "tool", "tool_call_id": "functions.x:0", "content": "1"}]), "messages"),
    (_body(messages=ASK + [{"role": "tool", "content": "1"}]), "messages"),
    (_body(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]), "messages"),
    (_body(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_agent_requests_are_400s_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in (error["param"] or "") or field in error["message"], error
    assert "\n" not in error["message"]


@pytest.mark.slow
def test_bad_completion_logprobs(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "logprobs": 6})
    assert r.status_code == 400 and "logprobs" in r.text
