"""Grammars a sequence is decoded under, by llguidance (chosen over xgrammar, measured in docs/PERFORMANCE.md): a
JSON schema (response_format json_schema, json_object) or a forced tool call in K2's format (tool_choice
"required" or a named function).

The grammars are Lark text with the JSON schemas embedded (`%json{...}`), and K2's markers as the special tokens
they are (`<|tool_call_begin|>` names the token; text can never spell it). JSON is generated with bounded
whitespace — one space after ':' and ',' and nowhere else — so a forced answer always ends: a model under a grammar
with free whitespace can emit it forever. On a template that thinks, the grammar opens with the thinking, free
text up to </think>, and constrains what follows (as vLLM applies a grammar after its reasoning parser's end).

A `Grammars` is made once per tokenizer (llguidance's view of the vocabulary takes about a second for K2's 163,840
tokens, so it is built on first use); `compile` checks a grammar and returns a `Grammar`, whose `matcher()` is one
sequence's state: the tokens allowed next (`allowed`), then the token chosen (`accept`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from k2trt.errors import K2Error
from k2trt.runtime.text.markers import (ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_BEGIN,
                                        THINK_END)

MAX_SCHEMA_CHARS = 64 << 10  # one schema as JSON text (a tool's parameters, a response format)
MAX_CALL_INDEX_DIGITS = 3  # the IDX of functions.NAME:IDX
MAX_PARALLEL_CALLS = 16  # the most calls a forced section holds, so it ends
# Bounded whitespace: what json.dumps writes by default (K2's tool arguments look so), nothing more.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(K2Error):
    """A grammar (or schema) the library refuses, or one too large."""


@dataclass(frozen=True)
class Grammar:
    source: str  # Lark text
    grammars: "Grammars"

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.grammars.new_matcher(self.source), self.grammars.tokenizer.stop_ids)


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, stop_ids):
        self._m, self._stop_ids = matcher, list(stop_ids)

    def allowed(self, vocab_size: int) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows next (only the stop tokens once it is complete)."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, bits.size)
        out[:n] = bits[:n]
        if not out.any():  # the matcher failed (it never should: it is fed only tokens it allowed): end the answer
            out[self._stop_ids] = True
        return out

    def accept(self, token: int) -> None:
        self._m.consume_token(token)

    @property
    def failed(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class Grammars:
    """The grammar library over one tokenizer's vocabulary; its stop tokens end every grammar."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.tiktoken

                t = self.tokenizer
                self._ll_tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
                    t._enc, n_vocab=t.vocab_size, eos_token=list(t.stop_ids))
            return self._ll_tokenizer

    def new_matcher(self, source: str):
        import llguidance

        return llguidance.LLMatcher(self._tokenizer(), source, log_level=0)

    def compile(self, source: str) -> Grammar:
        """A checked grammar (GrammarError saying why not, in one line)."""
        matcher = self.new_matcher(source)
        if matcher.is_error():
            raise GrammarError(_one_line(matcher.get_error()))
        return Grammar(source, self)


# ---- the grammars ---------------------------------------------------------------------------------------------

def schema_text(schema: Any, strict: bool, what: str) -> str:
    """A JSON schema embedded for llguidance with the bounded layout. `strict` (OpenAI's): every keyword is
    enforced, and one the library cannot enforce is an error; otherwise unsupported keywords are ignored."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON schema object")
    text = json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, "lenient": not strict}}, ensure_ascii=False)
    if len(text) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"{what} is {len(text):,} characters as JSON (the limit is {MAX_SCHEMA_CHARS:,})")
    return text


def _thinking(reasoning: bool) -> tuple[str, str]:
    """The start rule's prefix and its rules: free thinking up to </think> (the prompt may have opened it)."""
    if not reasoning:
        return "", ""
    return "think? ", f"think: {THINK_BEGIN}? THOUGHT? {THINK_END}\nTHOUGHT: /(?s:.+)/\n"


def json_grammar(schema_json: str, reasoning: bool = False) -> str:
    """An answer that is one JSON value of the schema (schema_text's output)."""
    prefix, rules = _thinking(reasoning)
    return f"start: {prefix}answer\nanswer: %json{schema_json}\n{rules}"


def tool_call_grammar(functions: list[tuple[str, str]], parallel: bool, reasoning: bool = False) -> str:
    """A tool-call section in K2's format calling one of `functions` — (name, schema_text of its parameters) —
    once, or 1..MAX_PARALLEL_CALLS times when `parallel`; nothing else. Names are OpenAI's [A-Za-z0-9_-]{1,64}."""
    prefix, rules = _thinking(reasoning)
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    count = f"{{1,{MAX_PARALLEL_CALLS}}}" if parallel else ""
    out = [f"start: {prefix}{SECTION_BEGIN} call{count} {SECTION_END}", f"call: {calls}"]
    for i, (name, schema) in enumerate(functions):
        out.append(f'call_{i}: {CALL_BEGIN} "functions.{name}:" INDEX {ARGUMENT_BEGIN} args_{i} {CALL_END}')
        out.append(f"args_{i}: %json{schema}")
    out.append(f"INDEX: /[0-9]{{1,{MAX_CALL_INDEX_DIGITS}}}/")
    return "\n".join(out) + "\n" + rules


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]
