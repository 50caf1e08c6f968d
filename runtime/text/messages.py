"""Chat messages to token ids, with message text always text: only the template's own markers are special tokens.

Encoding the rendered template with special tokens allowed (as transformers does) lets a user who types
`<|im_end|><|im_system|>system<|im_middle|>…` forge a system turn. Instead:

1. every text a request carries (a message's content, text parts, name, reasoning, tool call ids and arguments, a
   tool result's call id, and every string of the `tools`) is replaced by a placeholder — a private-use marker with
   a random nonce, so no message can spell one — and the template renders that;
2. the output is split at the placeholders: what is left is the template's own text, whose special-token
   spellings are the markers; the message texts go back in their places;
3. the stretches between markers (template text and message text together, so byte-pair merges are the same as
   for the whole string) are encoded as ordinary text, the markers as their ids.

The text encoded is checked to be exactly what the template renders for the real messages, so the ids always
decode to the template's output; for messages without marker spellings they equal the transformers way
exactly (a test checks). A template that changes message text (trims it, splits it) would render differently
around a placeholder than around the text, so it is refused with one line rather than encoded wrongly.
This is the encoding for every message list: `k2trt generate --chat`, `k2trt chat` and
an OpenAI-style server (system / user / assistant / tool roles; content a string or a list of text parts;
assistant tool calls and reasoning; the tools a request declares).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from k2trt.errors import K2Error

ROLES = ("system", "user", "assistant", "tool")
# the fields each role may carry (null fields are dropped first)
_FIELDS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
           "assistant": ("role", "content", "name", "tool_calls", "reasoning_content"),
           "tool": ("role", "content", "name", "tool_call_id")}


class MessageError(K2Error):
    """A message list the template cannot be given; `field` names the request field at fault (messages, tools)."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def normalize_messages(messages: Any) -> list[dict]:
    """Checked copies of OpenAI-style messages. Every message has a role (one of ROLES) and content: a string or
    [{"type": "text", "text": str}, ...] (an assistant turn with tool_calls may have none); "name" is a string. An
    assistant turn may carry `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments": a JSON
    string}}]) and `reasoning_content`; a tool turn carries the `tool_call_id` of an earlier call. Fields that are
    null are dropped; anything else is refused by index (MessageError)."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise MessageError(f"{where}: must be an object with role and content")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        unknown = [k for k in m if k not in _FIELDS[role]]
        if unknown:
            raise MessageError(f"{where}: field {unknown[0]!r} is not supported in a {role} message (it has "
                               f"{', '.join(_FIELDS[role])})")
        if role == "assistant" and "tool_calls" in m:
            if not isinstance(m["tool_calls"], list):
                raise MessageError(f"{where}: tool_calls must be a list")
            m["tool_calls"] = [_tool_call(c, f"{where} tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
            call_ids.update(c["id"] for c in m["tool_calls"])
            m.setdefault("content", "")
        content = m.get("content")
        if isinstance(content, list):
            content = [_text_part(part, f"{where} content part {j}") for j, part in enumerate(content)]
        elif not isinstance(content, str):
            raise MessageError(f"{where}: content must be a string or a list of text parts, got "
                               f"{type(content).__name__}")
        for key in ("name", "reasoning_content", "tool_call_id"):
            if key in m and not isinstance(m[key], str):
                raise MessageError(f"{where}: {key} must be a string")
        if role == "tool" and m.get("tool_call_id") not in call_ids:
            raise MessageError(f"{where}: tool_call_id {m.get('tool_call_id')!r} answers no earlier assistant "
                               "tool call")
        out.append({**m, "content": content})
    return out


def _tool_call(call: Any, where: str) -> dict:
    """{"id", "type": "function", "function": {"name", "arguments"}}: arguments a string holding a JSON object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type", "function") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
        raise MessageError(f"{where}: a tool call is {{\"id\": STRING, \"type\": \"function\", \"function\": "
                           "{\"name\": STRING, \"arguments\": STRING}}")
    try:
        json.loads(fn["arguments"])
    except ValueError as e:
        raise MessageError(f"{where}: function.arguments is not JSON ({e})") from None
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}


def _text_part(part: Any, where: str) -> dict:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise MessageError(f"{where}: type {kind!r} is not supported (text parts only: {{\"type\": \"text\", ...}})")
    if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise MessageError(f"{where}: a text part is {{\"type\": \"text\", \"text\": STRING}}")
    return dict(part)


class _Placeholders:
    """Stand-ins for the texts a request brings: `\\ue000<nonce>:<i>\\ue001`, private-use characters around a fresh
    nonce (JSON leaves them as they are, so they survive `tojson` too)."""

    def __init__(self):
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.pattern = re.compile("\ue000" + self.nonce + r":(\d+)" + "\ue001")

    def hold(self, text: str, as_json: bool = False) -> str:
        """`as_json`: the text is rendered inside a JSON string (the tools, through tojson), so it goes back
        escaped as JSON would escape it."""
        if not text:  # an empty text stays empty: templates test content for truth ({% if content %})
            return text
        self.texts.append(json.dumps(text, ensure_ascii=False)[1:-1] if as_json else text)
        return f"\ue000{self.nonce}:{len(self.texts) - 1}\ue001"

    def message(self, m: dict) -> dict:
        out = dict(m, content=self.hold(m["content"]) if isinstance(m["content"], str) else
                   [dict(p, text=self.hold(p["text"])) for p in m["content"]])
        for key in ("name", "reasoning_content", "tool_call_id"):
            if key in m:
                out[key] = self.hold(m[key])
        if "tool_calls" in m:
            out["tool_calls"] = [{"id": self.hold(c["id"]), "type": "function",
                                  "function": {"name": self.hold(c["function"]["name"]),
                                               "arguments": self.hold(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
        return out

    def json_value(self, value: Any) -> Any:
        """Every string of a JSON value (the tools: names, descriptions, schema keys and values) held."""
        if isinstance(value, str):
            return self.hold(value, as_json=True)
        if isinstance(value, list):
            return [self.json_value(v) for v in value]
        if isinstance(value, dict):
            return {self.hold(k, as_json=True): self.json_value(v) for k, v in value.items()}
        return value


def render_pieces(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                  **kwargs: Any) -> list[tuple[str, bool]]:
    """The rendered chat as (text, is_template) pieces, in order: False marks a message's own text."""
    holders = _Placeholders()
    messages = normalize_messages(messages)
    held = dict(kwargs)
    if kwargs.get("tools") is not None:
        held["tools"] = holders.json_value(kwargs["tools"])
    rendered = tokenizer.apply_chat_template([holders.message(m) for m in messages], add_generation_prompt, **held)
    pieces, pos = [], 0
    for match in holders.pattern.finditer(rendered):
        pieces += [(rendered[pos:match.start()], True), (holders.texts[int(match.group(1))], False)]
        pos = match.end()
    pieces.append((rendered[pos:], True))
    if (any(holders.nonce in text for text, own in pieces if own)
            or "".join(text for text, _ in pieces) != tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                                                   **kwargs)):
        raise MessageError(f"tokenizer {tokenizer.source}: the chat template changes message text, so it cannot be kept "
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
