"""Log-probabilities in the OpenAI API's shapes: the chat API's `logprobs.content` entries and the completions API's
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists. A token's text is its bytes decoded alone (a
character split across tokens shows as U+FFFD, its bytes say which); alternatives a grammar forbade (-inf) are
left out, as JSON has no infinity."""

from __future__ import annotations

import math

from k2trt.runtime.generation.sampling import TokenLogprob


def _token(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.id_to_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_entries(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    out = []
    for e in entries:
        text, raw = _token(tokenizer, e.token)
        top = []
        for t, lp in e.top:
            if math.isfinite(lp):
                t_text, t_raw = _token(tokenizer, t)
                top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        out.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], tokens: list[int], offset: int = 0) -> dict:
    """`entries[i]` belongs to `tokens[i]` (None: no log-probability, the prompt's first token); text offsets count
    from `offset` characters."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, e in zip(tokens, entries):
        text, _ = _token(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if e is None else e.logprob)
        out["top_logprobs"].append(None if e is None else
                                   {_token(tokenizer, t)[0]: lp for t, lp in e.top if math.isfinite(lp)})
    return out


def join(a: dict | None, b: dict) -> dict:
    """Two completions logprobs objects, one after the other."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
