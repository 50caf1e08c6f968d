"""`k2trt generate`: one prompt (or chat message) through the chosen backend, streamed, with a summary line;
`--json` prints one JSON object instead. A chat's answer is split as the server splits it (runtime/text/
chat_output.py): thinking shown dimmed (or hidden with --hide-thinking) and as `reasoning_content` in JSON, tool
calls (with --tools) as `tool_calls`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k2trt.args import at_least, checked, integer
from k2trt.errors import K2Error
from k2trt.files import parse_json, read_text
from k2trt.runtime.entrypoints.model import (add_model_arguments, add_pipeline_arguments, launch_if_asked, load_model,
                                          make_generator, progress_line)
from k2trt.runtime.generation.sampling import DEFAULTS, SamplingParams, field_problem
from k2trt.runtime.text.chat_output import ChatOutputParser, template_thinks
from k2trt.runtime.text.text_stream import StopRules


def _sampling_value(name: str, parse, kind: str):
    """An argparse type checked by the sampling field's own rule (runtime/generation/sampling.py)."""
    return checked(parse, lambda value: field_problem(name, value), kind)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--temperature", type=_sampling_value("temperature", float, "a number"),
                   default=DEFAULTS.temperature, help=f"0 = greedy (default {DEFAULTS.temperature:g})")
    p.add_argument("--top-k", type=_sampling_value("top_k", integer, "an integer"), default=DEFAULTS.top_k,
                   help=f"0 = off (default {DEFAULTS.top_k})")
    p.add_argument("--top-p", type=_sampling_value("top_p", float, "a number"), default=DEFAULTS.top_p,
                   help=f"1 = off (default {DEFAULTS.top_p:g})")
    p.add_argument("--seed", type=_sampling_value("seed", integer, "an integer"), default=DEFAULTS.seed,
                   help=f"(default {DEFAULTS.seed})")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=at_least(0), default=[], metavar="ID",
                   help="also stop at this token id (repeatable), besides [EOS] and <|im_end|>")
    p.add_argument("--hide-thinking", action="store_true",
                   help="do not show a thinking template's reasoning (it is shown dimmed)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", help="raw text, continued as is (repeat for a batch)")
    p.add_argument("--chat", action="append", help="a user message, wrapped in the chat template (repeatable)")
    add_sampling_arguments(p)
    p.add_argument("--tools", metavar="FILE.json", default=None,
                   help="tools the --chat model may call: a JSON list in the OpenAI API's shape")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_pipeline_arguments(p)


def check_requests(args) -> None:
    if not args.prompt and not args.chat:
        raise K2Error("give --prompt TEXT or --chat TEXT")


def to_sampling_params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def stop_rules(tok, args) -> StopRules:
    """The model's stop tokens, --stop-token-id and --stop: what ends a sequence and what is never shown."""
    return StopRules.of(tok, strings=args.stop, stop_ids=args.stop_token_id)


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


def chat_parser(tok, tools: list | None) -> ChatOutputParser | None:
    """The splitter of a chat answer: thinking (a template that thinks), tool calls (when tools are given)."""
    names = frozenset(t["function"]["name"] for t in tools) if tools else None
    thinks = template_thinks(tok)
    return ChatOutputParser(reasoning=thinks, tool_names=names) if thinks or names is not None else None


def read_tools(path: str | None) -> list | None:
    """--tools FILE.json: a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}."""
    if path is None:
        return None
    tools = parse_json(read_text(Path(path), missing=f"--tools file missing: {path}"), path)
    if not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise K2Error(f"{path}: --tools must be a JSON list of {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"parameters\": {...}}}")
    return tools


def split_answer(parser: ChatOutputParser, text: str) -> dict:
    """A chat answer's fields as the server returns them."""
    parser.feed(text)
    parser.finish()
    out = {"content": parser.content, "reasoning_content": parser.reasoning or None}
    if parser.tool_calls:
        out["tool_calls"] = [c.as_openai() for c in parser.tool_calls]
    return out


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


def encode_requests(tok, args, tools: list | None = None) -> list[list[int]]:
    """--prompt texts as they are, --chat texts through the chat template (with the tools); in the order given."""
    ids = []
    for text in args.prompt or []:
        if not text:
            raise K2Error("--prompt is empty")
        ids.append(tok.encode(text))
    for text in args.chat or []:
        ids.append(tok.encode_chat([{"role": "user", "content": text}], **({"tools": tools} if tools else {})))
    return ids


def run(args) -> int:
    check_requests(args)
    params = to_sampling_params(args)
    tools = read_tools(args.tools)
    launched = launch_if_asked(args)
    if launched is not None:
        return launched
    loaded = load_model(args)
    if loaded.follower:  # a pipeline rank other than 0: run rank 0's steps until it is done
        loaded.session.follow()
        return 0
    tok = loaded.tokenizer
    prompts = encode_requests(tok, args, tools)
    gen = make_generator(loaded, args)
    # a chat's answers are split into thinking, content and tool calls; --prompt text is all text
    chats = set(range(len(args.prompt or []), len(prompts)))
    parser = (lambda: chat_parser(tok, tools)) if chats else (lambda: None)
    # one request streams as it goes; a batch prints each sequence when all are done
    printer = None
    if len(prompts) == 1 and not args.json:
        printer = ChatPrinter(p, args.hide_thinking) if (p := parser()) is not None else StreamPrinter()
    results, timings = gen.generate(prompts, args.max_new_tokens, params, stop_rules(tok, args), on_text=printer,
                                    on_prefill=PrefillProgress(prompts, gen.limits.prefill_chunk))
    loaded.close()
    t = timings.as_dict()
    if args.json:
        objs = [{"backend": loaded.backend.name, "prompt_token_ids": r.prompt_ids, "token_ids": r.token_ids,
                 "text": r.text, "finish_reason": r.finish_reason, "cached_tokens": r.cached_tokens, "timings": t}
                for r in results]
        for i in chats:
            if (p := parser()) is not None:
                objs[i].update(split_answer(p, results[i].text))
        print(json.dumps(objs[0] if len(objs) == 1 else {"results": objs, "timings": t}, ensure_ascii=False))
        return 0
    if printer is not None:
        printer.finish()
    else:
        for i, r in enumerate(results):
            p = parser() if i in chats else None
            if p is None:
                print(f"--- [{i}] {r.text}")
            else:
                print(f"--- [{i}] ", end="")
                shown = ChatPrinter(p, args.hide_thinking)
                shown(i, r.text)
                shown.finish()
    new = sum(len(r.token_ids) for r in results)
    reasons = ", ".join(sorted({r.finish_reason for r in results}))
    where = f"{loaded.backend.name}, {loaded.session.layout.name}" if loaded.session else loaded.backend.name
    print(f"[{where}] prompt tokens {sum(len(p) for p in prompts)}, new tokens {new} ({reasons}); "
          f"prefill {t['prefill_tokens_per_s']} tok/s, decode {t['decode_tokens_per_s']} tok/s", file=sys.stderr)
    return 0
