"""Kimi's tiktoken tokenizer for transformers' AutoTokenizer (`trust_remote_code=True`).

k2trt make-tiny copies this file into the checkpoint beside tiktoken.model, as K2's releases ship theirs, and
tokenizer_config.json's auto_map names its class, so transformers (and vLLM, which loads tokenizers through it)
read the tiny's tokenizer. It is k2trt's own implementation, written to encode and decode exactly as k2trt's
runtime does (k2trt/runtime/text/tokenizer.py KimiTokenizer; a test compares them):

- base tokens: tiktoken byte-level BPE over `tiktoken.model` (one "<base64 bytes> <rank>" line per token) with
  Kimi's pre-tokenizer pattern;
- special tokens: the 256 ids right after the base tokens, named by tokenizer_config.json's added_tokens_decoder,
  the unnamed ones `<|reserved_token_{id}|>`; transformers keeps their spellings whole when it encodes text;
- decoding joins the tokens' bytes and decodes them as UTF-8, an incomplete character becoming U+FFFD.

transformers' slow-tokenizer machinery works on token strings, so every base token is spelled in GPT-2's
byte-to-character alphabet (a space is "Ġ"), which turns any bytes into a string and back without loss.
It imports only tiktoken and transformers: the model directory is used without k2trt installed.
"""

from __future__ import annotations

import base64
import os
import shutil

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

NUM_RESERVED_SPECIAL = 256

# Kimi's pre-tokenizer (k2trt.runtime.text.tokenizer.KIMI_PAT_STR; a test keeps the two equal): Han runs stay apart
# from other letters, digits split in groups of up to three.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte: the printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, DEL, NBSP, soft hyphen) for chr(256), chr(257), ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def read_ranks(path: str) -> dict[bytes, int]:
    """tiktoken.model, read directly (tiktoken's own loader caches files by their path in a temp directory)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                 pad_token="[PAD]", added_tokens_decoder: dict | None = None, **kwargs):
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        self.num_base_tokens = n = len(ranks)
        # The special slots: the config's names (AddedToken objects from transformers, or plain strings), the rest
        # reserved. All of them become added tokens, so their spellings are never split into base tokens.
        given = {int(i): t if isinstance(t, AddedToken) else AddedToken(str(t), special=True, normalized=False)
                 for i, t in (added_tokens_decoder or {}).items()}
        added = {i: AddedToken(f"<|reserved_token_{i}|>", special=True, normalized=False)
                 for i in range(n, n + NUM_RESERVED_SPECIAL)}
        added.update(given)  # and tokens added after the 256 slots (tokenizer.add_tokens, then saved)

        # Base tokens: their bytes by id, and their spellings in the byte alphabet both ways.
        self._bytes = [b""] * n
        for token, rank in ranks.items():
            self._bytes[rank] = token
        alphabet = byte_alphabet()
        self._byte_of = {c: b for b, c in enumerate(alphabet)}
        self._spelling = ["".join(alphabet[b] for b in token) for token in self._bytes]
        self._id_of = {s: i for i, s in enumerate(self._spelling)}
        # No special tokens here: transformers cuts them out of the text before _tokenize sees it.
        self._model = tiktoken.Encoding("kimi", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added, **kwargs)

    # ---- the vocabulary -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the base tokens and the 256 special slots (config.json's vocab_size)."""
        return self.num_base_tokens + NUM_RESERVED_SPECIAL

    def get_vocab(self) -> dict[str, int]:
        return {**self._id_of, **{t.content: i for i, t in self._added_tokens_decoder.items()}}

    def _convert_token_to_id(self, token: str) -> int:
        return self._id_of.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._spelling[index]

    # ---- encoding and decoding ------------------------------------------------------------------
    def _tokenize(self, text: str, **kwargs) -> list[str]:
        """Text with no special tokens in it (transformers splits them off first) -> base token spellings."""
        return [self._spelling[i] for i in self._model.encode_ordinary(text)]

    def _token_bytes(self, token: str) -> bytes:
        if token in self._added_tokens_encoder:
            return token.encode("utf-8")
        return bytes(self._byte_of[c] for c in token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return b"".join(self._token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                **kwargs) -> str:
        """All the ids' bytes decoded at once (a character split across tokens comes out whole), as tiktoken
        decodes; the config's clean_up_tokenization_spaces is false, so no spaces are touched."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        parts = [self._added_tokens_decoder[i].content.encode("utf-8") if i in self._added_tokens_decoder
                 else self._bytes[i] for i in ids if i not in skip]
        return b"".join(parts).decode("utf-8", errors="replace")

    # ---- saving ---------------------------------------------------------------------------------
    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
