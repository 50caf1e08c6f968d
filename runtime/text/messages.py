"""Chat messages to token ids, with message text always text: only the template's own markers are special tokens.

Encoding the rendered template with special tokens allowed (as transformers does) lets a user who types
`<|im_end|><|im_system|>system<|im_middle|>…` forge a system turn. Instead:

1. every text a message carries (its content, each text part, its name) is replaced by a placeholder — a
   private-use marker with a random nonce, so no message can spell one — and the template renders that;
2. the output is split at the placeholders: what is left is the template's own text, whose special-token
   spellings are the markers; the message texts go back in their places;
3. the stretches between markers (template text and message text together, so byte-pair merges are the same as
   for the whole string) are encoded as ordinary text, the markers as their ids.

The text encoded is checked to be exactly what the template renders for the real messages, so the ids always
decode to the template's output; for messages without marker spellings they equal the transformers way
exactly (a test checks). A template that changes message text (trims it, splits it) would render differently
around a placeholder than around the text, so it is refused with one line rather than encoded wrongly.
This is the encoding for every message list: `k2trt generate --chat`, `k2trt chat` and
an OpenAI-style server (system / user / assistant roles; content a string or a list of text parts).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from k2trt.errors import K2Error

ROLES = ("system", "user", "assistant")
_FIELDS = ("role", "content", "name")


def normalize_messages(messages: Any) -> list[dict]:
    """Checked copies of OpenAI-style messages: {"role": one of ROLES, "content": str | [{"type": "text", "text":
    str}, ...], "name": str (optional)}. Fields that are null are dropped; anything else is refused by index."""
    if not isinstance(messages, list) or not messages:
        raise K2Error("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise K2Error(f"{where}: must be an object with role and content")
        m = {k: v for k, v in m.items() if v is not None}
        unknown = [k for k in m if k not in _FIELDS]
        if unknown:
            raise K2Error(f"{where}: field {unknown[0]!r} is not supported (a message has {', '.join(_FIELDS)})")
        if m.get("role") not in ROLES:
            raise K2Error(f"{where}: role {m.get('role')!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            content = [_text_part(part, f"{where} content part {j}") for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise K2Error(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
        if "name" in m and not isinstance(m["name"], str):
            raise K2Error(f"{where}: name must be a string")
        out.append({**m, "content": content})
    return out


def _text_part(part: Any, where: str) -> dict:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise K2Error(f"{where}: type {kind!r} is not supported (text parts only: {{\"type\": \"text\", ...}})")
    if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise K2Error(f"{where}: a text part is {{\"type\": \"text\", \"text\": STRING}}")
    return dict(part)


class _Placeholders:
    """Stand-ins for message texts: `\\ue000<nonce>:<i>\\ue001`, private-use characters around a fresh nonce."""

    def __init__(self):
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.pattern = re.compile("\ue000" + self.nonce + r":(\d+)" + "\ue001")

    def hold(self, text: str) -> str:
        if not text:  # an empty text stays empty: templates test content for truth ({% if content %})
            return text
        self.texts.append(text)
        return f"\ue000{self.nonce}:{len(self.texts) - 1}\ue001"

    def message(self, m: dict) -> dict:
        out = dict(m, content=self.hold(m["content"]) if isinstance(m["content"], str) else
                   [dict(p, text=self.hold(p["text"])) for p in m["content"]])
        if "name" in m:
            out["name"] = self.hold(m["name"])
        return out


def render_pieces(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                  **kwargs: Any) -> list[tuple[str, bool]]:
    """The rendered chat as (text, is_template) pieces, in order: False marks a message's own text."""
    holders = _Placeholders()
    messages = normalize_messages(messages)
    rendered = tokenizer.apply_chat_template([holders.message(m) for m in messages], add_generation_prompt, **kwargs)
    pieces, pos = [], 0
    for match in holders.pattern.finditer(rendered):
        pieces += [(rendered[pos:match.start()], True), (holders.texts[int(match.group(1))], False)]
        pos = match.end()
    pieces.append((rendered[pos:], True))
    if (any(holders.nonce in text for text, own in pieces if own)
            or "".join(text for text, _ in pieces) != tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                                                   **kwargs)):
        raise K2Error(f"tokenizer {tokenizer.source}: the chat template changes message text, so it cannot be kept "
                      "apart from the template's markers (k2trt needs templates that insert message text unchanged)")
    return [(text, own) for text, own in pieces if text]


def encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
    """Markers in template pieces become their ids; everything between them is encoded as one ordinary text."""
    ids: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            ids.extend(tokenizer.encode("".join(pending)))
            pending.clear()

    for text, own in pieces:
        if not own:
            pending.append(text)
            continue
        pos = 0
        for match in tokenizer.special_pattern.finditer(text):
            pending.append(text[pos:match.start()])
            flush()
            ids.append(tokenizer.token_to_id(match.group()))
            pos = match.end()
        pending.append(text[pos:])
    flush()
    return ids


def encode_messages(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """Token ids of a chat: the template's markers as special ids, every message text as text."""
    return encode_pieces(tokenizer, render_pieces(tokenizer, messages, add_generation_prompt, **kwargs))
