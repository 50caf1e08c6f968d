"""Grammars (runtime/text/grammar.py) and the sampler's use of them: whatever the model's logits — random here —
a forced answer is valid JSON of its schema or a K2-format tool call the parser reads back, its whitespace is
bounded, and it ends; a row's mask leaves the other rows of the step alone; log-probabilities are the float32
log-softmax of the logits the sampler saw."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from k2trt.runtime.generation.sampling import Sampler, SamplingParams, logprobs_of, sample_rows
from k2trt.runtime.text import grammar as G
from k2trt.runtime.text.chat_output import ChatOutputParser
from k2trt.runtime.text.tokenizer import KimiTokenizer
from k2trt.tiny.tokenizer import write_tiny_tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "alerts": {"type": "boolean"}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
PING = {"type": "object", "properties": {"host": {"type": "string", "maxLength": 8}}, "required": ["host"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d, 2048 - 256)
    return KimiTokenizer.from_dir(d)


@pytest.fixture(scope="module")
def grammars(tok):
    return G.Grammars(tok)


def decode_under(tok, grammar, seed: int, steps: int = 400) -> str:
    """Random logits through a sampler under the grammar until a stop token: the text it made."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), grammar)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        (token,) = sample_rows([sampler], torch.randn(1, tok.vocab_size, generator=gen) * 4)
        if token in tok.stop_ids:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"no stop token in {steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_a_json_schema_answer_always_validates_and_ends(tok, grammars, seed):
    g = grammars.compile(G.json_grammar(G.schema_text(WEATHER, True, "schema")))
    text = decode_under(tok, g, seed)
    jsonschema.validate(json.loads(text), WEATHER)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # json.dumps' layout: bounded whitespace


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_forced_tool_call_always_parses_into_valid_calls(tok, grammars, seed, parallel):
    functions = [("get_weather", G.schema_text(WEATHER, True, "w")), ("ping", G.schema_text(PING, True, "p"))]
    g = grammars.compile(G.tool_call_grammar(functions, parallel=parallel))
    text = decode_under(tok, g, seed, steps=3000)
    parser = ChatOutputParser(tool_names=frozenset({"get_weather", "ping"}))
    parser.feed(text)
    parser.finish()
    assert parser.content == "" and parser.tool_calls and (parallel or len(parser.tool_calls) == 1)
    for call in parser.tool_calls:
        assert call.id.startswith(f"functions.{call.name}:")
        jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "get_weather" else PING)


def test_json_object_and_non_strict_schemas(tok, grammars):
    g = grammars.compile(G.json_grammar(G.schema_text({"type": "object", "maxProperties": 0}, False, "s")))
    assert json.loads(decode_under(tok, g, 0)) == {}
    # an unknown keyword is an error under strict, ignored without it (OpenAI's strict: every keyword enforced)
    odd = {"type": "object", "x-frobnicate": 1, "properties": {"a": {"type": "boolean"}}}
    grammars.compile(G.json_grammar(G.schema_text(odd, False, "s")))


@pytest.mark.parametrize("schema, says", [
    ({"type": "frobnicate"}, "frobnicate"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
])
def test_a_schema_the_library_refuses_is_one_line(grammars, schema, says):
    with pytest.raises(G.GrammarError) as e:
        grammars.compile(G.json_grammar(G.schema_text(schema, True, "s")))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_schemas_are_bounded():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(G.GrammarError, match="the limit is"):
        G.schema_text(big, True, "response_format")
    with pytest.raises(G.GrammarError, match="must be a JSON schema object"):
        G.schema_text([1], True, "response_format")


def test_a_grammar_row_leaves_the_other_rows_alone(tok, grammars):
    """Batch invariance: the rows beside a masked one choose what they choose alone."""
    g = grammars.compile(G.json_grammar(G.schema_text(PING, True, "p")))
    logits = torch.randn(3, tok.vocab_size, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.8, seed=7)]
    alone = [sample_rows([Sampler(p)], logits[r:r + 1].clone())[0] for r, p in enumerate(params)]
    for masked in range(3):
        samplers = [Sampler(p, g if r == masked else None) for r, p in enumerate(params)]
        together = sample_rows(samplers, logits.clone())
        assert [t for r, t in enumerate(together) if r != masked] == [t for r, t in enumerate(alone) if r != masked]
        assert tok.decode([together[masked]]).startswith("{")


def test_logprobs_are_the_log_softmax_the_sampler_saw(tok, grammars):
    logits = torch.randn(2, tok.vocab_size, generator=torch.Generator().manual_seed(2))
    plain, masked = Sampler(SamplingParams(logprobs=5)), \
        Sampler(SamplingParams(logprobs=5), grammars.compile(G.json_grammar(G.schema_text(PING, True, "p"))))
    tokens = sample_rows([plain, masked], logits.clone())
    expected = torch.log_softmax(logits[0].float(), -1)
    assert plain.chosen.token == tokens[0] == int(expected.argmax())  # greedy's choice is the first alternative
    assert plain.chosen.top[0] == (tokens[0], pytest.approx(plain.chosen.logprob))
    assert [t for t, _ in plain.chosen.top] == torch.topk(expected, 5).indices.tolist()
    assert plain.chosen.logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-6)
    # under a grammar only its tokens have probability: the opening brace tokens share all of it
    assert sum(torch.tensor([lp for _, lp in masked.chosen.top]).exp().tolist()) == pytest.approx(1.0, abs=1e-5)
    assert logprobs_of(logits[:1], [3], 0)[0].top == ()
