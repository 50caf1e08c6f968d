"""An EAGLE-3 draft proposing tokens for the scheduler's verify steps, in one process, on the torch reference's math
(graphs/eagle.py) in float32.

How a draft follows its sequence (vLLM's and SGLang's scheme): at position p it reads the target's residual stream
entering the aux layers (Executor.take_aux, through `fc`) and the embedding of the token that followed p, and its
output there predicts the token after that. So after every step that computed positions s .. s + n − 1 of a sequence
— a prompt chunk, or a verify step's committed positions (the last token and the drafts kept) — `advance` runs the
draft over those n pairs, writing its own KV cache at those positions; `propose` then runs it k − 1 more times on its
own output (its pre-norm hidden fed back, the drafted token embedded) and gives the k tokens, mapped to target ids
(d2t), then cuts its cache back to the committed positions. The cache rolls back by length, never by copying: a
step that starts at s drops everything from s on first (rejected drafts, a preempted sequence recomputing).

Where a sequence's positions were not all computed here — a prefix-cache hit — the draft has no state for them and
proposes nothing for that sequence (verification stays exact either way). Proposals are argmax (a one-hot q), so the
verify step's sampling (speculation.py) keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k2trt.draft import Draft
from k2trt.errors import K2Error
from k2trt.graphs import eagle
from k2trt.graphs.mask import simple_mask
from k2trt.graphs.ops import TorchOps


@dataclass
class _Sequence:
    """One sequence's draft state: its KV cache over positions 0 .. length − 1, and its output at the last one."""
    k: torch.Tensor  # [1, kv heads, length, head_dim]
    v: torch.Tensor
    last_out: torch.Tensor | None = None  # [1, 1, H]: fed back as the next step's hidden
    last_logits: torch.Tensor | None = None  # [1, 1, draft vocab]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def cut(self, length: int) -> None:
        self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class EagleDrafter:
    def __init__(self, draft: Draft, target_embedding: torch.Tensor | None):
        cfg = draft.config
        if cfg.layout != "llama":
            raise K2Error(f"{draft.root}: MLA-layout EAGLE-3 drafts load but do not run yet; use a Llama-layout draft")
        self.cfg = cfg
        self.w = {name: t.float() for name, t in draft.tensors.items() if t.dtype.is_floating_point}
        embed = draft.tensors.get("embed_tokens.weight", target_embedding)
        if embed is None:
            raise K2Error(f"{draft.root}: the draft shares the target's embedding, and none was given")
        self.embed = embed.float()
        self.target_ids = draft.target_ids
        self.ops = TorchOps("float32")
        self.sequences: dict[object, _Sequence] = {}

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    def _run(self, seq: _Sequence, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The layer over len(tokens) positions after the sequence's cache (hidden [1, n, H]): its cache grows;
        -> its output [1, n, H]."""
        n, start = len(tokens), seq.length
        positions = torch.arange(start, start + n)[None]
        cos, sin = eagle.rope_tables(self.cfg, positions)
        embeds = self.embed[torch.tensor(tokens)][None]
        out, k_new, v_new = eagle.draft_layer(self.ops, self.cfg, embeds, hidden, cos, sin,
                                              simple_mask(1, start, n), seq.k, seq.v, self.w)
        seq.k, seq.v = torch.cat([seq.k, k_new], dim=2), torch.cat([seq.v, v_new], dim=2)
        return out

    def advance(self, key, start: int, next_tokens: list[int], aux: torch.Tensor) -> None:
        """The target computed positions start .. start + n − 1 of sequence `key` and committed them; next_tokens[i]
        follows position start + i; aux [n, 3 × target H] is the residual stream there."""
        seq = self.sequences.get(key)
        if start == 0:
            kv = torch.zeros(1, self.cfg.num_key_value_heads, 0, self.cfg.head_dim)
            seq = self.sequences[key] = _Sequence(kv, kv.clone())
        elif seq is None or seq.length < start:  # positions it never saw (a prefix-cache hit): no drafts
            self.sequences.pop(key, None)
            return
        seq.cut(start)
        if not next_tokens:
            return
        out = self._run(seq, list(next_tokens), eagle.draft_fc(self.ops, self.cfg, aux[None].float(), self.w))
        seq.last_out = out[:, -1:]
        seq.last_logits = eagle.draft_head(self.ops, self.cfg, seq.last_out, self.w)

    def propose(self, key, k: int) -> list[int]:
        """Up to k draft tokens (target ids) after the sequence's committed positions; none without state."""
        seq = self.sequences.get(key)
        if seq is None or seq.last_logits is None or k < 1:
            return []
        committed = seq.length
        out, logits, tokens = seq.last_out, seq.last_logits, []
        for i in range(k):
            tokens.append(int(self.target_ids[int(logits[0, -1].argmax())]))
            if i + 1 < k:
                out = self._run(seq, tokens[-1:], out)
                logits = eagle.draft_head(self.ops, self.cfg, out, self.w)
        seq.cut(committed)
        return tokens

    def forget(self, key) -> None:
        self.sequences.pop(key, None)


def make_drafter(speculation, cfg, weights) -> EagleDrafter | None:
    """The drafter a --speculative-config asks for (None unless eagle3): the draft loaded for the target config,
    the target's embedding shared where the draft has none."""
    if speculation is None or speculation.method != "eagle3":
        return None
    from k2trt.draft import load_draft

    draft = load_draft(speculation.model, cfg)
    name = "model.embed_tokens.weight"
    embedding = None if not draft.shares_embedding else weights.globals([name])[name]
    return EagleDrafter(draft, embedding)
