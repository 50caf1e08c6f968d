"""Kimi's tokenizer: tiktoken byte-level BPE plus 256 reserved special ids, and its Jinja chat template.

Loads a Kimi model directory unchanged (the real K2 one or the tiny generated one):
`tiktoken.model` holds the base ranks, `tokenizer_config.json` names the special ids and holds the
chat template. Special ids sit right after the base tokens, so the base count fixes every special id.
Every field read from tokenizer_config.json is checked for its JSON type where it is read (a list where a name
is expected is a one-line error, not a silent default); special_tokens_map.json, which names the same special
tokens for other loaders, is not read.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import os
import re
from pathlib import Path
from typing import Any, Iterable

import tiktoken

from k2trt.errors import K2Error
from k2trt.files import read_bounded, read_json_object, read_text
from k2trt.schema import json_kind
from k2trt.runtime.text.chat_template import ChatTemplate
from k2trt.runtime.text.messages import encode_messages

NUM_RESERVED_SPECIAL = 256

# Kimi's pre-tokenizer: Han runs stay apart from other letters; digits split in groups of up to three.
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "*" + _LETTERS_LOWER + "+" + _CONTRACTIONS,
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "+" + _LETTERS_LOWER + "*" + _CONTRACTIONS,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer HF checkpoints keep the template here instead
MAX_TEMPLATE_BYTES = 1 << 20  # K2's template is 4 KB


def reserved_name(token_id: int) -> str:
    """The name of a special slot that tokenizer_config.json does not name."""
    return f"<|reserved_token_{token_id}|>"


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse tiktoken.model; ranks must be exactly 0..n-1 so the special ids can follow them."""
    data = read_bounded(path, missing=f"tokenizer file missing: {path}")
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (ValueError, binascii.Error):
            raise K2Error(f"{path}:{lineno}: malformed rank line (expected '<base64 token> <rank>')") from None
        if not token or token in ranks or rank in seen_ranks or rank < 0:
            raise K2Error(f"{path}:{lineno}: empty or duplicate token, or duplicate/negative rank {rank}")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise K2Error(f"{path}: no ranks")
    if max(seen_ranks) != len(ranks) - 1:
        raise K2Error(f"{path}: ranks are not contiguous 0..{len(ranks) - 1} (largest is {max(seen_ranks)})")
    return ranks


def _token_content(entry: Any) -> str | None:
    """HF writes special tokens either as plain strings or as AddedToken dicts with "content"."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _named_token(config: dict, key: str, default: str, path: Path) -> str:
    """bos_token and the like: absent or null is the default name; otherwise a name, as HF writes it."""
    entry = config.get(key)
    if entry is None:
        return default
    name = _token_content(entry)
    if name is None:
        raise K2Error(f"{path}: {key} must be a token name (a string, or an object with a string \"content\"), "
                      f"got {_json_kind(entry)}")
    return name


def _json_kind(value: Any) -> str:
    """How a wrong JSON value is described in an error: its type, and the value when short."""
    kind = json_kind(value)
    text = repr(value)
    return f"{kind} {text}" if len(text) <= 40 else kind


def _special_names(config: dict, num_base: int, path: Path) -> dict[str, int]:
    named: dict[int, str] = {}
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise K2Error(f"{path}: added_tokens_decoder must be an object")
    for key, entry in decoder.items():
        content = _token_content(entry)
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if content is None:
            raise K2Error(f"{path}: added_tokens_decoder entry {key!r} must be a token name (a string, or an object "
                          f"with a string \"content\"), got {_json_kind(entry)}")
        if not num_base <= token_id < num_base + NUM_RESERVED_SPECIAL:
            raise K2Error(f"{path}: added_tokens_decoder entry {key!r} is not a named special id in "
                          f"{num_base}..{num_base + NUM_RESERVED_SPECIAL - 1} (does it match {RANKS_FILE}?)")
        named[token_id] = content
    specials: dict[str, int] = {}
    for token_id in range(num_base, num_base + NUM_RESERVED_SPECIAL):
        name = named.get(token_id, reserved_name(token_id))
        if name in specials:
            raise K2Error(f"{path}: special token {name!r} names both id {specials[name]} and id {token_id}")
        specials[name] = token_id
    return specials


def _template_source(config: dict, model_dir: Path, path: Path) -> tuple[str, Path | str] | None:
    """Where the chat template is, read only when a chat is encoded (a broken template never stops a plain
    prompt): ("file", path) when chat_template.jinja exists (whatever it is: a FIFO there is refused, not skipped),
    else ("text", the template in tokenizer_config.json); ("error", why) for a chat_template of the wrong shape."""
    template_file = model_dir / TEMPLATE_FILE
    if os.path.lexists(template_file):
        return "file", template_file
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return None if template is None else ("text", template)
    if not isinstance(template, list):
        return "error", (f"{path}: chat_template must be a string or a list of named templates, got "
                         f"{_json_kind(template)}")
    by_name = {}  # HF's named-template form: [{"name": ..., "template": ...}]
    for i, entry in enumerate(template):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            return "error", (f"{path}: chat_template[{i}] must be an object with a string \"name\" and a string "
                             f"\"template\", got {_json_kind(entry)}")
        by_name[entry["name"]] = entry["template"]
    return ("text", by_name["default"]) if "default" in by_name else None


class KimiTokenizer:
    def __init__(self, encoding: tiktoken.Encoding, num_base_tokens: int, specials: dict[str, int],
                 chat_template: tuple[str, Path | str] | None, special_map: dict[str, str], source: Path):
        self._enc = encoding
        self.num_base_tokens = num_base_tokens
        self._specials = specials
        self._template_source = chat_template
        self._compiled_template: ChatTemplate | None = None
        self._special_map = special_map  # bos_token etc., passed to the template as HF does
        self.source = source
        self.bos_id = self.token_to_id(special_map["bos_token"])
        self.eos_id = self.token_to_id(special_map["eos_token"])
        self.pad_id = self.token_to_id(special_map["pad_token"])
        self.im_end_id = self.token_to_id("<|im_end|>")
        # A chat turn ends with <|im_end|>; [EOS] ends a plain completion.
        self.stop_ids = [self.eos_id, self.im_end_id]

    @classmethod
    def from_dir(cls, path: str | Path) -> "KimiTokenizer":
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise K2Error(f"tokenizer directory missing: {model_dir}")
        ranks = load_ranks(model_dir / RANKS_FILE)
        config_path = model_dir / CONFIG_FILE
        config = read_json_object(config_path, "a Kimi tokenizer names its special tokens there")
        num_base = len(ranks)
        specials = _special_names(config, num_base, config_path)
        special_map = {key: _named_token(config, key, default, config_path)
                       for key, default in (("bos_token", "[BOS]"), ("eos_token", "[EOS]"),
                                            ("pad_token", "[PAD]"), ("unk_token", "[UNK]"))}
        encoding = tiktoken.Encoding(model_dir.resolve().name or "kimi", pat_str=KIMI_PAT_STR,
                                     mergeable_ranks=ranks, special_tokens=specials)
        return cls(encoding, num_base, specials, _template_source(config, model_dir, config_path), special_map,
                   model_dir)

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_RESERVED_SPECIAL

    def token_to_id(self, name: str) -> int:
        """A special token's id by name, or a base token's rank given its text."""
        if name in self._specials:
            return self._specials[name]
        try:
            return self._enc.encode_single_token(name.encode("utf-8"))
        except KeyError:
            raise K2Error(f"tokenizer {self.source}: no token named {name!r}") from None

    def has_token(self, name: str) -> bool:
        """Whether `name` is one of its named special tokens (</think> in the thinking releases)."""
        return name in self._specials and not name.startswith("<|reserved_token_")

    def id_to_bytes(self, token_id: int) -> bytes:
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            raise K2Error(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})") from None

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Without allow_special, text such as "<|im_end|>" is split like any other text (safe for user input)."""
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        try:
            return self._enc.decode(ids, errors="replace")
        except KeyError:
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            raise K2Error(f"token id {bad[0] if bad else '?'} is outside the vocabulary "
                          f"(size {self.vocab_size})") from None

    def _template(self) -> ChatTemplate:
        if self._compiled_template is None:
            if self._template_source is None:
                raise K2Error(f"tokenizer {self.source}: no chat_template in {CONFIG_FILE} or {TEMPLATE_FILE}")
            kind, value = self._template_source
            if kind == "error":
                raise K2Error(value)
            if kind == "file":
                self._compiled_template = ChatTemplate(read_text(value, MAX_TEMPLATE_BYTES), str(value))
            else:
                self._compiled_template = ChatTemplate(value, f"{self.source / CONFIG_FILE}: chat_template")
        return self._compiled_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The template's text for these messages, rendered within its limits (runtime/text/chat_template.py)."""
        return self._template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **self._special_map, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of OpenAI-style messages: the template's markers are special ids, message text is always
        text, whatever it spells (runtime/text/messages.py)."""
        return encode_messages(self, messages, add_generation_prompt, **kwargs)

    @functools.cached_property
    def special_pattern(self) -> re.Pattern:
        """Any special token's spelling, longest first (so a name that extends another wins)."""
        return re.compile("|".join(re.escape(n) for n in sorted(self._specials, key=len, reverse=True)))

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns ids into text one at a time; a UTF-8 character split across tokens is held until complete."""

    def __init__(self, tokenizer: KimiTokenizer):
        self._tokenizer = tokenizer
        # The incremental decoder holds back incomplete trailing bytes and gives the same text as a one-shot decode.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.id_to_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD); the decoder starts afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
