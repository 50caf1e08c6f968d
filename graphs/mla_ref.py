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
