"""Paged MLA attention in plain torch, dense: the references of runtime/kernels/mla_decode.py (absorbed, below)
and mla_prefill.py (decompressed, paged_mla_prefill_reference).

The attention graphs/blocks.attention computes (absorbed form), with its cache in pages as
runtime/cache/pools.PagedLatentCache holds it: per layer a pool [pages · page_tokens, latent + rope] whose row is a
position's normalized latent c and rotated rope key k_pe; a sequence's page table lists its pages in position order.
For each sequence: gather its rows through its page table, score every query row q_full = [q_nope · W_uk, q_pe]
against them (· softmax_scale), mask causally among the Q new queries (the sequence's last Q positions: query j
attends to positions < len − Q + j + 1), softmax in fp32 and return Σ p · c, the latent part only (the caller
multiplies it by W_uv). Everything in fp32; an fp8 pool is dequantized first, value = fp8 · scale.
"""

from __future__ import annotations

import torch


def paged_rows(table: torch.Tensor, length: int, page_tokens: int) -> torch.Tensor:
    """The pool rows (int64 [length]) of positions 0 .. length − 1 of a sequence with page table `table`."""
    pos = torch.arange(length, device=table.device)
    return table.long()[pos // page_tokens] * page_tokens + pos % page_tokens


def dequantized(pool: torch.Tensor, kv_scale) -> torch.Tensor:
    """The pool's values in fp32: an fp8 pool times its per-tensor kv_scale."""
    kv = pool.float()
    if pool.dtype == torch.float8_e4m3fn:
        kv = kv * torch.as_tensor(kv_scale, dtype=torch.float32, device=pool.device)
    return kv


def paged_mla_decode_reference(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor,
                               lengths: torch.Tensor, softmax_scale: float,
                               page_tokens: int, kv_scale: torch.Tensor | float | None = None,
                               latent_dim: int = 512, new: torch.Tensor | None = None,
                               n_new: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, H, latent + rope], pool [rows, latent + rope], page_tables [B, max_pages], lengths [B] (positions
    held, the Q new ones included), positions per page (runtime/cache/pages.PAGE_TOKENS) -> o [B, Q, H, latent]
    in q's dtype. A query with no position to attend (a length of 0) gets 0.
    With `new` [B, Q, latent + rope]: the pool holds only the context (`lengths` of it) and sequence b's first
    n_new[b] (default Q) rows of `new` follow it, as they are (no kv_scale); queries past n_new[b] get 0."""
    b, n_q, heads, _ = q.shape
    kv_all = dequantized(pool, kv_scale)
    out = torch.zeros(b, n_q, heads, latent_dim, dtype=torch.float32, device=q.device)
    for i in range(b):
        ctx = int(lengths[i])
        kv = kv_all[paged_rows(page_tables[i], ctx, page_tokens)]  # [ctx, latent + rope]
        if new is None:
            n, real = ctx, n_q
            limit = n - n_q + torch.arange(n_q, device=q.device) + 1  # query j: positions < len - Q + j + 1
        else:
            real = n_q if n_new is None else int(n_new[i])
            kv = torch.cat([kv, new[i, :real].float()])
            n = ctx + real
            limit = ctx + torch.arange(real, device=q.device) + 1
        if n == 0 or real == 0:
            continue
        scores = torch.einsum("qhd,nd->qhn", q[i, :real].float(), kv) * softmax_scale  # [Q, H, n]
        visible = torch.arange(n, device=q.device)[None, :] < limit[:, None]  # [Q, n]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with nothing visible: 0
        out[i, :real] = torch.einsum("qhn,nd->qhd", probs, kv[:, :latent_dim])
    return out.to(q.dtype)


def paged_mla_prefill_reference(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor,
                                lengths: torch.Tensor, n_new: torch.Tensor, wkv: torch.Tensor,
                                softmax_scale: float, page_tokens: int, v_head_dim: int,
                                kv_scale: torch.Tensor | float | None = None,
                                latent_dim: int = 512, new: torch.Tensor | None = None) -> torch.Tensor:
    """The decompressed form (graphs/blocks.attend_decompressed) over a paged context, dense: the reference of
    runtime/kernels/mla_prefill.py. q [B, T, H, nope + rope] (q_pe rotated), sequence b's first n_new[b] queries
    real and at its last n_new[b] positions (lengths count them); wkv [H · (nope + v), latent] (kv_b) -> o [B, T, H,
    v] in q's dtype, 0 for padding queries. Each context row's latent goes through wkv into its keys' nope part and
    its value, kept in q's dtype (as the activation-dtype graphs and the kernel keep them); the rest in fp32.
    With `new` [B, T, latent + rope]: the pool holds the context only (`lengths` of it) and sequence b's rows
    new[b, :n_new[b]] follow it, as they are (no kv_scale)."""
    b, n_q, heads, qd = q.shape
    rope = pool.shape[-1] - latent_dim
    nope = qd - rope
    kv_all = dequantized(pool, kv_scale)
    out = torch.zeros(b, n_q, heads, v_head_dim, dtype=torch.float32, device=q.device)
    for i in range(b):
        n, t = int(lengths[i]), int(n_new[i])
        rows = kv_all[paged_rows(page_tables[i], n, page_tokens)]  # [n, latent + rope]
        if new is not None:
            rows = torch.cat([rows, new[i, :t].float()])
            n += t
        if n == 0 or t == 0:
            continue
        kv = (rows[:, :latent_dim] @ wkv.float().T).to(q.dtype).float().view(n, heads, nope + v_head_dim)
        k = torch.cat([kv[..., :nope], rows[:, None, latent_dim:].expand(n, heads, rope)], dim=-1)  # [n, H, 192]
        scores = torch.einsum("qhd,nhd->qhn", q[i, :t].float(), k) * softmax_scale  # [t, H, n]
        visible = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]  # [t, n]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[i, :t] = torch.einsum("qhn,nhd->qhd", torch.softmax(scores, dim=-1), kv[..., nope:])
    return out.to(q.dtype)


# ---- the TensorRT plugins' stages (graphs/contracts.MLA_STAGES), each on its own -----------------------------

LOG2E = 1.4426950408889634
EMPTY_MAX = -1.0e30  # an empty split's running max (finite, so the merge weighs it 0 without NaN)


def split_partials_reference(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, lengths: torch.Tensor,
                             new: torch.Tensor, n_new: torch.Tensor, softmax_scale: float, page_tokens: int,
                             splits: int, latent_dim: int = 512, kv_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """MlaDecodeSplit: sequence b's context pages dealt in equal runs over `splits` (run = ceil(pages / splits)
    pages; the last split also the step's rows new[b, :n_new[b]]), each split's partial softmax of each (query,
    head) in base 2: m = max of score · softmax_scale · log2 e over what it sees (EMPTY_MAX if nothing),
    l = Σ 2^(s − m), acc = Σ 2^(s − m) · row[:latent], in fp32. -> part_acc [B, Q, H, S, latent], part_ml
    [B, Q, H, S, 2]."""
    b, n_q, heads, _ = q.shape
    kv_all = dequantized(pool, kv_scale)
    acc = torch.zeros(b, n_q, heads, splits, latent_dim)
    ml = torch.zeros(b, n_q, heads, splits, 2)
    ml[..., 0] = EMPTY_MAX
    for i in range(b):
        ctx, real = int(lengths[i]), int(n_new[i])
        rows = torch.cat([kv_all[paged_rows(page_tables[i], ctx, page_tokens)], new[i, :real].float()])
        run = -(-(-(-ctx // page_tokens)) // splits) * page_tokens  # positions per split
        for s in range(splits):
            lo, hi = min(s * run, ctx), min((s + 1) * run, ctx)
            idx = list(range(lo, hi)) + (list(range(ctx, ctx + real)) if s == splits - 1 else [])
            for j in range(real):
                seen = [p for p in idx if p < ctx + j + 1]
                if not seen:
                    continue
                part = rows[seen]  # [n, latent + rope]
                scores = torch.einsum("hd,nd->hn", q[i, j].float(), part) * (softmax_scale * LOG2E)
                m = scores.max(dim=-1).values
                p = torch.exp2(scores - m[:, None])
                acc[i, j, :, s] = p @ part[:, :latent_dim]
                ml[i, j, :, s, 0], ml[i, j, :, s, 1] = m, p.sum(-1)
    return acc, ml


def merge_partials_reference(part_acc: torch.Tensor, part_ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MlaDecodeMerge: o = Σ_s acc_s · 2^(m_s − M) / Σ_s l_s · 2^(m_s − M), M = max_s m_s; 0 where every l_s = 0."""
    m, l = part_ml[..., 0], part_ml[..., 1]
    w = torch.exp2(m - m.max(dim=-1, keepdim=True).values)
    total = (l * w).sum(-1, keepdim=True)
    o = (part_acc * w[..., None]).sum(-2) / torch.where(total > 0, total, torch.ones_like(total))
    return o.to(dtype)


def decompress_reference(pool: torch.Tensor, page_tables: torch.Tensor, lengths: torch.Tensor, n_new: torch.Tensor,
                         new: torch.Tensor, wkv: torch.Tensor, page_tokens: int, positions: int,
                         latent_dim: int = 512, kv_scale=None) -> torch.Tensor:
    """MlaDecompress: kv [B, positions, H · (nope + v)] in wkv's dtype, row p of sequence b its position p's latent
    through wkv (pool rows · kv_scale); NaN past the sequence's positions (the contract leaves them unwritten)."""
    b = page_tables.shape[0]
    kv_all = dequantized(pool, kv_scale)
    out = torch.full((b, positions, wkv.shape[0]), float("nan"))
    for i in range(b):
        ctx, real = int(lengths[i]), int(n_new[i])
        rows = torch.cat([kv_all[paged_rows(page_tables[i], ctx, page_tokens)], new[i, :real].float()])
        out[i, :ctx + real] = rows[:, :latent_dim] @ wkv.float().T
    return out.to(wkv.dtype)
