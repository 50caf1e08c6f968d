"""An EAGLE-3 draft proposing tokens for the scheduler's verify steps, on the process that schedules, its pieces
computed by a draft runner (runtime/backends/drafts.py: the draft's engines or exported graphs, as the target's
backend gives them, or its math in graphs/eagle.py), in float32.

How a draft follows its sequence (vLLM's and SGLang's scheme): at position p it reads the target's residual stream
entering the aux layers (Executor.take_aux, through `fc`) and the embedding of the token that followed p, and its
output there predicts the token after that. So after every step that computed positions s .. s + n − 1 of a sequence
— a prompt chunk, or a verify step's committed positions (the last token and the drafts kept) — `advance` runs the
draft over those n pairs, writing its own cache at those positions; `propose` then runs it k − 1 more times on its
own output (its pre-norm hidden fed back, the drafted token embedded) and gives the k tokens, mapped to target ids
(d2t), its cache left at the committed positions. Every call runs all its sequences as one batch (caches and chunks
padded under one mask). The Llama layout keeps keys and values per KV head; the MLA layout its latent rows, its
attention the target's own (graphs/blocks.attention, absorbed or decompressed by T). The cache rolls back by length,
never by copying: a step that starts at s drops everything from s on first (rejected drafts, a preempted sequence
recomputing).

A prefix-cache hit restores the draft's cache over the pages reused from the pages the draft kept as sequences
filled them (`keep_pages` / `restore`, keyed by the page's key and the token after it, since the draft's last
position on a page read the next page's first token); where one is missing the sequence proposes nothing
(verification stays exact either way). Proposals are argmax (a one-hot q), so the verify step's sampling
(speculation.py) keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k2trt.config import K2Config
from k2trt.draft import Draft
from k2trt.errors import K2Error
from k2trt.graphs import eagle, rope
from k2trt.graphs.mask import attention_mask
from k2trt.runtime.backends.drafts import TorchDraftRunner


@dataclass
class _Sequence:
    """One sequence's draft state: its cache over positions 0 .. length − 1 — (k, v) [1, kv heads, L, head_dim]
    for the Llama layout, (latent,) [1, L, kv_lora + rope] for the MLA one — and its output at the last one; then
    the committed positions not computed yet (their next tokens and aux states), computed when it proposes."""
    parts: list[torch.Tensor]
    axis: int  # the positions' axis of each part
    last_out: torch.Tensor | None = None  # [1, 1, H]: fed back as the next step's hidden
    last_logits: torch.Tensor | None = None  # [1, 1, draft vocab]
    pending_tokens: list[int] = field(default_factory=list)
    pending_aux: torch.Tensor | None = None  # [n, 3 × target H], on the runner's device in its dtype

    @property
    def length(self) -> int:
        """Positions computed."""
        return self.parts[0].shape[self.axis]

    @property
    def total(self) -> int:
        """Positions followed: computed and pending."""
        return self.length + len(self.pending_tokens)

    def cut(self, length: int) -> None:
        """Keep positions 0 .. length − 1 (a step that starts there: rejected drafts, recomputation)."""
        if length <= self.length:
            if length < self.length:
                self.parts = [p.narrow(self.axis, 0, length) for p in self.parts]
                self.last_out = self.last_logits = None
            self.pending_tokens, self.pending_aux = [], None
        else:
            keep = length - self.length
            self.pending_tokens = self.pending_tokens[:keep]
            self.pending_aux = self.pending_aux[:keep]

    def follow(self, tokens: list[int], aux: torch.Tensor) -> None:
        """aux [len(tokens), 3 × target H]: already where the runner computes, in its dtype."""
        self.pending_tokens = self.pending_tokens + list(tokens)
        self.pending_aux = aux if self.pending_aux is None else torch.cat([self.pending_aux, aux])
        self.last_out = self.last_logits = None  # the output at the last position is not computed yet


PAGE_STORE = 1024  # draft cache pages kept for prefix hits (least recently stored dropped first)
MAX_PENDING = 256  # positions a sequence follows before they are computed anyway (one chunk of the layer)


class EagleDrafter:
    def __init__(self, draft: Draft, target_embedding: torch.Tensor | None, target: K2Config | None = None,
                 runner=None):
        self.cfg = cfg = draft.config
        self.mla = cfg.layout == "mla"
        if self.mla and target is None:
            raise K2Error(f"{draft.root}: an MLA-layout draft needs its target's config")
        self.attn_cfg = cfg.attention_config(target) if self.mla else None
        self.axis = 1 if self.mla else 2
        self.runner = runner or TorchDraftRunner(draft, target_embedding, target)
        # the draft's caches and pending aux states live where its runner computes, in its dtype (a TensorRT
        # draft's on the GPU: no cache crosses to the host and back each call); the page store on the host
        self.device, self.dtype = self.runner.device, self.runner.cache_dtype
        limit = self.runner.max_positions  # TensorRT's profiles bound a call's positions
        self.max_pending = min(MAX_PENDING, limit) if limit else MAX_PENDING
        self.target_ids = draft.target_ids
        self.sequences: dict[object, _Sequence] = {}
        # (page key, the token after the page) -> the draft's cache over the page: the page key names the page's
        # tokens and all before them, and the draft's last position there also read the next page's first token
        self.pages: dict[tuple, list[torch.Tensor]] = {}

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layer_ids

    @property
    def suggested_k(self) -> int | None:
        """The draft's own k (a speculators draft names it), used where --speculative-config gives none."""
        return self.cfg.speculative_tokens

    def sibling(self) -> "EagleDrafter":
        """A drafter of the same draft with no sequences of its own, sharing this one's runner (the weights once):
        one per micro-batch lane."""
        twin = object.__new__(EagleDrafter)
        twin.__dict__.update(self.__dict__)
        twin.sequences, twin.pages = {}, {}
        return twin

    def _empty(self) -> _Sequence:
        where = {"device": self.device, "dtype": self.dtype}
        if self.mla:
            return _Sequence([torch.zeros(1, 0, self.attn_cfg.latent_dim, **where)], self.axis)
        kv = torch.zeros(1, self.cfg.num_key_value_heads, 0, self.cfg.head_dim, **where)
        return _Sequence([kv, kv.clone()], self.axis)

    def _padded(self, past: list[list[torch.Tensor]], extra: int = 0) -> list[torch.Tensor]:
        """Sequences' cache parts (past[b]: its positions 0 .. L_b − 1) as one batch, each part padded to the
        longest L plus `extra` slots — room for positions written later (propose_many's drafted ones)."""
        axis = self.axis
        p = max(parts[0].shape[axis] for parts in past) + extra
        padded = []
        for j in range(len(past[0])):
            shape = list(past[0][j].shape)
            shape[0], shape[axis] = len(past), p
            buf = torch.zeros(shape, device=self.device, dtype=self.dtype)
            for i, parts in enumerate(past):
                buf[i].narrow(axis - 1, 0, parts[j].shape[axis]).copy_(parts[j][0])
            padded.append(buf)
        return padded

    def _layer(self, padded: list[torch.Tensor], lengths: list[int], tokens: list[list[int]], hidden: torch.Tensor,
               starts: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The layer for B sequences at once: their caches `padded` (_padded; sequence b's first lengths[b] slots
        hold its positions, the rest are masked), its new tokens at positions starts[b] + j, hidden [B, T, H]
        (rows past a sequence's tokens are padding, their outputs meaningless). -> (out [B, T, H], the new
        positions' cache parts, batched)."""
        b, t, p = len(tokens), hidden.shape[1], padded[0].shape[self.axis]
        key_valid = torch.zeros(b, p + t, dtype=torch.bool)
        for i, n in enumerate(lengths):
            key_valid[i, :n] = True
            key_valid[i, p:p + len(tokens[i])] = True
        query_pos = torch.tensor(starts)[:, None] + torch.arange(t)[None]
        key_pos = torch.cat([torch.arange(p).expand(b, p), query_pos], dim=1)
        mask = attention_mask(query_pos, key_pos, key_valid)
        ids = torch.tensor([row + [0] * (t - len(row)) for row in tokens])
        cos, sin = rope.rope_tables(self.attn_cfg, query_pos) if self.mla else eagle.rope_tables(self.cfg, query_pos)
        return self.runner.layer(ids, hidden, cos.float(), sin.float(), mask, padded)

    def _write(self, padded: list[torch.Tensor], lengths: list[int], news: list[torch.Tensor]) -> None:
        """One new position of each sequence (news: the layer's, T = 1) into its next free slot of `padded`."""
        for part, new in zip(padded, news):
            for b, n in enumerate(lengths):
                part[b].narrow(self.axis - 1, n, 1).copy_(new[b])

    def advance(self, key, start: int, next_tokens: list[int], aux: torch.Tensor) -> None:
        """The target computed positions start .. start + n − 1 of sequence `key` and committed them; next_tokens[i]
        follows position start + i; aux [n, 3 × target H] is the residual stream there."""
        self.advance_many([(key, start, next_tokens, aux)])

    def advance_many(self, items: list[tuple]) -> None:
        """advance for several sequences. The positions are followed, not computed: the draft computes them, all
        its sequences' pending positions as one batch, when a sequence proposes (`flush`) — so while speculation
        is paused or a request backs off, following costs nothing but keeping the aux states (MAX_PENDING at
        most)."""
        due = []
        for key, start, next_tokens, aux in items:
            seq = self.sequences.get(key)
            if start == 0:
                seq = self.sequences[key] = self._empty()
            elif seq is None or seq.total < start:  # positions it never saw (a prefix-cache hit): no drafts
                self.sequences.pop(key, None)
                continue
            seq.cut(start)
            if not next_tokens:
                continue
            if seq.pending_tokens and len(seq.pending_tokens) + len(next_tokens) > self.max_pending:
                self.flush([key])
            seq.follow(next_tokens, aux[:len(next_tokens)].to(self.device, self.dtype))
            if len(seq.pending_tokens) >= self.max_pending:
                due.append(key)
        if due:
            self.flush(due)

    def flush(self, keys=None) -> None:
        """Compute the pending positions of these sequences (default: all), their layers run as one batch."""
        keys = list(self.sequences) if keys is None else keys
        seqs = [self.sequences.get(key) for key in keys]
        run = [(seq, seq.pending_tokens, seq.pending_aux) for seq in seqs if seq is not None and seq.pending_tokens]
        if not run:
            return
        t = max(len(tokens) for _, tokens, _ in run)
        aux = torch.zeros(len(run), t, run[0][2].shape[-1], device=self.device, dtype=self.dtype)
        for i, (_, tokens, a) in enumerate(run):
            aux[i, :len(tokens)] = a
        hidden = self.runner.fc(aux)
        lengths = [s.length for s, _, _ in run]
        out, news = self._layer(self._padded([s.parts for s, _, _ in run]), lengths, [tok for _, tok, _ in run],
                                hidden, lengths)
        last = torch.stack([out[i, len(tokens) - 1] for i, (_, tokens, _) in enumerate(run)])[:, None]  # [B, 1, H]
        logits = self.runner.head(last)
        for i, (seq, tokens, _) in enumerate(run):
            seq.parts = [torch.cat([part, new[i:i + 1].narrow(self.axis, 0, len(tokens))], dim=self.axis)
                         for part, new in zip(seq.parts, news)]
            seq.last_out, seq.last_logits = last[i:i + 1], logits[i:i + 1]
            seq.pending_tokens, seq.pending_aux = [], None

    def propose(self, key, k: int) -> list[int]:
        """Up to k draft tokens (target ids) after the sequence's committed positions; none without state."""
        return self.propose_many([(key, k)])[0]

    def propose_many(self, asks: list[tuple]) -> list[list[int]]:
        """propose for several sequences: each draft step of all of them one batch; their caches are left as
        committed (the drafted positions live in a working copy)."""
        self.flush([key for key, k in asks if k >= 1])
        live = [(i, self.sequences.get(key), k) for i, (key, k) in enumerate(asks)]
        live = [(i, seq, k) for i, seq, k in live if seq is not None and seq.last_logits is not None and k >= 1]
        result: list[list[int]] = [[] for _ in asks]
        if not live:
            return result
        seqs = [seq for _, seq, _ in live]
        out = torch.cat([seq.last_out for seq in seqs])  # [B, 1, H]
        logits = torch.cat([seq.last_logits for seq in seqs])
        steps = max(k for _, _, k in live)
        # the committed caches padded once, with room for the drafted positions: each draft step writes its one
        # position in place instead of copying every sequence's cache again
        padded = self._padded([seq.parts for seq in seqs], steps - 1)
        lengths = [seq.length for seq in seqs]
        for step in range(steps):
            drafted = self.target_ids[logits[:, -1].argmax(-1).cpu()].tolist()  # one sync for the batch
            for (i, _, k), tok in zip(live, drafted):
                if step < k:
                    result[i].append(tok)
            if step + 1 == steps:
                break
            out, news = self._layer(padded, lengths, [[tok] for tok in drafted], out, lengths)
            self._write(padded, lengths, news)
            lengths = [n + 1 for n in lengths]
            logits = self.runner.head(out)
        return result

    def forget(self, key) -> None:
        self.sequences.pop(key, None)

    # ---- prefix reuse: the draft's cache follows the target's pages ------------------------------------------------
    def keep_pages(self, key, page_keys: list[bytes], tokens: list[int], page_tokens: int) -> None:
        """Store the sequence's draft cache over each of its full pages it has computed (page_keys in position
        order, tokens its tokens so far), for a later sequence whose prefix hits them."""
        seq = self.sequences.get(key)
        if seq is None:
            return
        wanted = [(i, pk) for i, pk in enumerate(page_keys)
                  if (i + 1) * page_tokens < len(tokens) and (pk, tokens[(i + 1) * page_tokens]) not in self.pages]
        if any(seq.length < (i + 1) * page_tokens <= seq.total for i, _ in wanted):
            self.flush([key])  # a page filled while its positions were pending: computed once per page at most
        for i, pk in enumerate(page_keys):
            end = (i + 1) * page_tokens
            if end >= len(tokens) or seq.length < end:
                break
            store_key = (pk, tokens[end])
            if store_key not in self.pages:
                self.pages[store_key] = [p.narrow(self.axis, end - page_tokens, page_tokens).to("cpu", copy=True)
                                         for p in seq.parts]
        while len(self.pages) > PAGE_STORE:
            self.pages.pop(next(iter(self.pages)))

    def restore(self, key, page_keys: list[bytes], tokens: list[int], page_tokens: int) -> None:
        """A sequence admitted with its first len(page_keys) pages from the prefix cache: its draft cache over
        them from the pages kept, if every one is (else it proposes nothing: advance finds positions it never saw)."""
        stored = [self.pages.get((pk, tokens[(i + 1) * page_tokens])) if (i + 1) * page_tokens < len(tokens)
                  else None for i, pk in enumerate(page_keys)]
        if not page_keys or any(s is None for s in stored):
            self.sequences.pop(key, None)
            return
        seq = self._empty()
        seq.parts = [torch.cat([s[j] for s in stored], dim=self.axis).to(self.device)
                     for j in range(len(seq.parts))]
        self.sequences[key] = seq


def make_drafter(speculation, cfg, weights, backend=None) -> EagleDrafter | None:
    """The drafter a --speculative-config asks for (None unless eagle3): the draft loaded for the target config,
    the target's embedding shared where the draft has none, run on the target backend's exported graphs where
    they hold the draft's (Backend.draft_runner), else on its math."""
    if speculation is None or speculation.method != "eagle3":
        return None
    from k2trt.draft import load_draft

    draft = load_draft(speculation.model, cfg)
    name = "model.embed_tokens.weight"
    embedding = None if not draft.shares_embedding else weights.globals([name])[name]
    runner = backend.draft_runner(draft, embedding) if backend is not None else None
    return EagleDrafter(draft, embedding, cfg, runner)
