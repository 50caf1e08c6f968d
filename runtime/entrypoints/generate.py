"""`k2trt generate`: one prompt (or chat message) through the chosen backend, streamed, with a summary line;
`--json` prints one JSON object instead. A chat's answer is split as the server splits it (runtime/text/
chat_output.py): thinking shown dimmed (or hidden with --hide-thinking) and as `reasoning_content` in JSON, tool
calls (with --tools) as `tool_calls`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from k2trt.errors import K2Error
from k2trt.files import parse_json, read_text
from k2trt.runtime.entrypoints.model import launch_if_asked, load_model, make_generator
from k2trt.runtime.entrypoints.printers import ChatPrinter, PrefillProgress, StreamPrinter
from k2trt.runtime.entrypoints.sampling_args import stop_rules, to_sampling_params
from k2trt.runtime.text.chat_output import chat_parser, split_answer


def check_requests(args) -> None:
    if not args.prompt and not args.chat:
        raise K2Error("give --prompt TEXT or --chat TEXT")


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
        spec = {}
        if args.speculative_config is not None:  # vLLM's counters, and the tokens a verify step gave on average
            c = gen.scheduler.spec_counters
            spec = {"speculative": {"method": args.speculative_config.method, "num_drafts": c.num_drafts,
                                    "num_draft_tokens": c.num_draft_tokens,
                                    "num_accepted_tokens": c.num_accepted_tokens,
                                    "mean_accepted_length": c.mean_accepted_length}}
            if gen.scheduler.drafter is not None:  # an EAGLE-3 draft's pieces: its exported graphs, or its math
                spec["speculative"]["draft_runs_on"] = gen.scheduler.drafter.runner.name
        objs = [{"backend": loaded.backend.name, "prompt_token_ids": r.prompt_ids, "token_ids": r.token_ids,
                 "text": r.text, "finish_reason": r.finish_reason, "cached_tokens": r.cached_tokens, "timings": t,
                 **spec} for r in results]
        for i in chats:
            objs[i].update(split_answer(parser(), results[i].text))
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
