"""`k2trt chat`: an interactive loop with history, through the same backends as generate.
Type a message; `/reset` clears the history, `/exit` (or end of input) leaves. A turn that cannot be answered
(past the context limit, a template that fails) is refused with one line and left out of the history; the
conversation goes on."""

from __future__ import annotations

import sys

from k2trt.errors import K2Error
from k2trt.runtime.entrypoints.printers import ChatPrinter, PrefillProgress, StreamPrinter
from k2trt.runtime.entrypoints.sampling_args import stop_rules, to_sampling_params
from k2trt.runtime.text.chat_output import chat_parser
from k2trt.runtime.entrypoints.model import load_model, make_generator


def run(args) -> int:
    from k2trt.runtime.distributed.world import launched

    params = to_sampling_params(args)
    if launched():  # under torchrun every rank would read the terminal
        raise K2Error("k2trt chat runs in one process; for pipeline stages use generate or serve (--pipeline)")
    loaded = load_model(args, command="chat")
    tok = loaded.tokenizer
    gen = make_generator(loaded, args)
    stops = stop_rules(tok, args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            history = list(base)
            print("(history cleared)")
            continue
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line}]
        try:
            prompt = tok.encode_chat(turn)
            gen.check([prompt], args.max_new_tokens, params)
        except K2Error as e:
            print(f"k2trt chat: error: {e} (this message was not sent; /reset starts over)", file=sys.stderr)
            continue
        history = turn
        parser = chat_parser(tok, None)
        printer = ChatPrinter(parser, args.hide_thinking) if parser is not None else StreamPrinter()
        progress = PrefillProgress([prompt], gen.limits.prefill_chunk, "k2trt chat")

        def on_prefill(request) -> None:
            progress(request)
            if request.fed == len(request.prompt):  # the reply starts after any progress line
                sys.stdout.write("k2> ")
                sys.stdout.flush()

        results, timings = gen.generate([prompt], args.max_new_tokens, params, stops, on_text=printer,
                                        on_prefill=on_prefill)
        printer.finish()
        # the reply as shown: cut at a stop string (generation ended there too), without stop tokens; a thinking
        # template's reasoning kept apart (its template keeps the last round's)
        if parser is None:
            history.append({"role": "assistant", "content": results[0].text})
        else:
            history.append({"role": "assistant", "content": parser.content,
                            **({"reasoning_content": parser.reasoning} if parser.reasoning else {})})
        t = timings.as_dict()
        print(f"[{len(prompt)} prompt tokens, {len(results[0].token_ids)} new; "
              f"decode {t['decode_tokens_per_s']} tok/s]", file=sys.stderr)
