"""Triton paged MLA prefill attention, decompressed form, reading the latent cache where it lies (no gather).

The form graphs/blocks.attend_decompressed computes, for a chunk of new positions over a paged context: every
context position's latent c (pool row, read through the sequence's page table) goes through kv_b into its
per-head key (nope, beside the shared rotated rope key k_pe of the same row) and value, then ordinary causal
attention per head. Two kernels, as vLLM, SGLang and TensorRT-LLM prefill MLA (decompress with a GEMM, then
attend with flash attention):

  1. decompress_kernel, grid (B, position blocks, column blocks): a GEMM whose rows are pool rows looked up
     through the page table: kv[b, p] = c[b, p] · W_kvᵀ, W_kv = kv_b [H · (nope + v), latent] (head-major, each
     head's W_uk rows then its W_uv rows, as kv_b_proj stores them), fp32 accumulation, rounded to the query
     dtype (the reference rounds its keys and values to the activation dtype too). Position blocks past a
     sequence's length do nothing;
  2. attend_kernel, grid (B, H, query blocks): flash attention of BLOCK_M new queries of one head over the
     sequence's positions, online softmax in fp32 (base 2), the keys' rope part read from the pool through the
     page table, causal: the chunk's n new positions are the sequence's last n, query j at position
     len − n + j sees positions ≤ its own. Position blocks past the block's last query are skipped.

As a block graph calls it (HAS_NEW), the pool holds the context only and the chunk's rows come dense
[B, T, 576], read where the pool's would be (decompressed and attended as they are, no kv_scale); otherwise the
new rows are already in the pool. Ragged chunks: `n_new[b]` ≤ T new positions per sequence (queries j ≥ n_new[b] are padding and get o = 0);
`lengths[b]` counts every position held, the new ones included (already written to the pool, as the decode
kernel expects). The context is decompressed into a scratch [B, P, H · (nope + v)] of the query dtype, P the
tables' capacity (or `max_positions`): by graphs/blocks.decompress_from a decompressed step's keys and values
take no more memory than its scores would, and a TensorRT plugin takes it as workspace sized from the profile.

Numerics as mla_decode.py: fp32 scores and softmax, dots in the "math dtype" (mla_decode.math_dtype), an fp8
pool's per-tensor scale applied to fp32 dot results, probabilities rounded to a 16-bit math dtype before the
second dot, page ids clamped into the pool, lengths into the table, nothing read past a sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k2trt.runtime.kernels.fp8_linear import FP_FUSION, checked_out, to_act
from k2trt.runtime.kernels.mla_decode import (KV_LORA_RANK, check_new, math_constexprs, mma, online_softmax_step,
                                              operand, pool_scale)


@triton.jit
def _extent(len_ptr, n_new_ptr, b, n_q, max_pages, p_cap, PAGE: tl.constexpr, HAS_NEW: tl.constexpr):
    """(positions in the pool, positions in all, new positions) of sequence b, clamped to what the table and the
    scratch hold; with HAS_NEW the pool holds the context and the new rows come dense after it."""
    held = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), max_pages * PAGE)
    if HAS_NEW:
        total = tl.minimum(held + tl.minimum(tl.maximum(tl.load(n_new_ptr + b), 0), n_q), p_cap)
        in_pool = tl.minimum(held, total)
    else:
        total = tl.minimum(held, p_cap)
        in_pool = total
    n_new = tl.minimum(tl.maximum(tl.load(n_new_ptr + b), 0), tl.minimum(n_q, total))
    return in_pool, total, n_new


@triton.jit
def _rows(pool_ptr, table_ptr, new_ptr, b, pos, cols, in_pool, total, n_q, max_pages, pool_pages,
          D: tl.constexpr, PAGE: tl.constexpr, MATH: tl.constexpr, DOT16: tl.constexpr):
    """Columns `cols` of positions `pos`: pool rows through the table below `in_pool`, the step's dense rows
    from there to `total`, each in the math dtype (nothing loaded past `total`)."""
    from_pool = pos < in_pool
    from_new = (pos >= in_pool) & (pos < total)
    page = tl.load(table_ptr + b.to(tl.int64) * max_pages + pos // PAGE, mask=from_pool, other=0)
    page = tl.minimum(tl.maximum(page, 0), pool_pages - 1)
    pooled = tl.load(pool_ptr + (page.to(tl.int64) * PAGE + pos % PAGE)[:, None] * D + cols[None, :],
                     mask=from_pool[:, None], other=0.0)
    dense = tl.load(new_ptr + (b.to(tl.int64) * n_q + (pos - in_pool).to(tl.int64))[:, None] * D + cols[None, :],
                    mask=from_new[:, None], other=0.0)
    return tl.where(from_pool[:, None], operand(pooled, MATH, DOT16), operand(dense, MATH, DOT16))


@triton.jit
def decompress_kernel(pool_ptr, kv_scale_ptr, table_ptr, len_ptr, n_new_ptr, new_ptr, w_ptr, n_q, max_pages,
                      pool_pages, p_cap, N, kv_ptr, D: tl.constexpr, DL: tl.constexpr, PAGE: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      MATH: tl.constexpr, DOT16: tl.constexpr, OUT: tl.constexpr, HAS_NEW: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_pool, seq_len, _ = _extent(len_ptr, n_new_ptr, b, n_q, max_pages, p_cap, PAGE, HAS_NEW)
    if tl.program_id(1) * BLOCK_P < seq_len:  # a block past the sequence's length has nothing to decompress
        held = pos < seq_len
        col_ok = cols < N
        acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
        for k0 in range(0, DL, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            c = _rows(pool_ptr, table_ptr, new_ptr, b, pos, ks, in_pool, seq_len, n_q, max_pages, pool_pages, D,
                      PAGE, MATH, DOT16)  # [P, K]
            w = tl.load(w_ptr + cols.to(tl.int64)[None, :] * DL + ks[:, None], mask=col_ok[None, :], other=0.0)
            acc = mma(c, operand(w, MATH, DOT16), acc, DOT16)  # [P, N]
        acc = acc * tl.where(pos < in_pool, tl.load(kv_scale_ptr), 1.0)[:, None]  # the step's rows as they are
        out = kv_ptr + (b.to(tl.int64) * p_cap + pos.to(tl.int64))[:, None] * N + cols[None, :]
        tl.store(out, to_act(acc, OUT), mask=held[:, None] & col_ok[None, :])


@triton.jit
def attend_kernel(q_ptr, pool_ptr, kv_scale_ptr, table_ptr, len_ptr, n_new_ptr, new_ptr, kv_ptr, n_q, max_pages,
                  pool_pages, p_cap, o_ptr,
                  H: tl.constexpr, NOPE: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, D: tl.constexpr,
                  DL: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SM_SCALE: tl.constexpr, MATH: tl.constexpr, DOT16: tl.constexpr, OUT: tl.constexpr,
                  HAS_NEW: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # the block's queries
    in_pool, seq_len, n_new = _extent(len_ptr, n_new_ptr, b, n_q, max_pages, p_cap, PAGE, HAS_NEW)
    q_ok = j < n_new
    q_pos = seq_len - n_new + j  # a query sees positions <= its own

    QD: tl.constexpr = NOPE + DR
    KVW: tl.constexpr = NOPE + DV  # one head's columns of the decompressed rows
    q_rows = q_ptr + ((b.to(tl.int64) * n_q + j.to(tl.int64)) * H + h)[:, None] * QD
    q_nope = operand(tl.load(q_rows + tl.arange(0, NOPE)[None, :], mask=q_ok[:, None], other=0.0), MATH, DOT16)
    q_pe = operand(tl.load(q_rows + NOPE + tl.arange(0, DR)[None, :], mask=q_ok[:, None], other=0.0), MATH, DOT16)
    kv_scale = tl.load(kv_scale_ptr)
    log2e: tl.constexpr = 1.4426950408889634

    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DV), tl.float32)
    kv_head = kv_ptr + b.to(tl.int64) * p_cap * (H * KVW) + h * KVW
    # causal: nothing past the block's last query (and nothing at all for a block of padding queries)
    hi = tl.minimum(seq_len, seq_len - n_new + tl.minimum((tl.program_id(2) + 1) * BLOCK_M, n_new))
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        held = pos < seq_len
        k_pe = _rows(pool_ptr, table_ptr, new_ptr, b, pos, DL + tl.arange(0, DR), in_pool, seq_len, n_q, max_pages,
                     pool_pages, D, PAGE, MATH, DOT16)
        rows = kv_head + pos.to(tl.int64)[:, None] * (H * KVW)
        k_nope = tl.load(rows + tl.arange(0, NOPE)[None, :], mask=held[:, None], other=0.0)
        v = tl.load(rows + NOPE + tl.arange(0, DV)[None, :], mask=held[:, None], other=0.0)

        s_pe = mma(q_pe, tl.trans(k_pe), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT16)
        s_pe = s_pe * tl.where(pos < in_pool, kv_scale, 1.0)[None, :]  # the step's rows as they are
        s = mma(q_nope, tl.trans(operand(k_nope, MATH, DOT16)), s_pe, DOT16) * (SM_SCALE * log2e)
        s = tl.where((pos[None, :] <= q_pos[:, None]) & held[None, :] & q_ok[:, None], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, operand(v, MATH, DOT16), m_i, l_i, acc, MATH, DOT16)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding query: nothing attended, o = 0
    o_rows = o_ptr + ((b.to(tl.int64) * n_q + j.to(tl.int64)) * H + h)[:, None] * DV
    tl.store(o_rows + tl.arange(0, DV)[None, :], to_act(o, OUT), mask=(j < n_q)[:, None])


@dataclass(frozen=True)
class MlaPrefillConfig:
    """Tiles of the two kernels: the decompression GEMM (positions × columns × latent step) and the attention
    (queries × positions), the attention's the usual flash-attention tile for head widths 128-192."""
    decompress_p: int = 64
    decompress_n: int = 64
    decompress_k: int = 64
    decompress_warps: int = 4
    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_CONFIG = MlaPrefillConfig()


def _pow2(name: str, v: int) -> None:
    if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two ≥ 16 (tl.arange, tl.dot), got {v}")


def mla_prefill(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, lengths: torch.Tensor,
                n_new: torch.Tensor, wkv: torch.Tensor, softmax_scale: float,
                kv_scale: torch.Tensor | float | None = None, *, page_tokens: int, v_head_dim: int,
                latent_dim: int = KV_LORA_RANK, max_positions: int | None = None,
                config: MlaPrefillConfig = DEFAULT_CONFIG, out: torch.Tensor | None = None,
                new: torch.Tensor | None = None) -> torch.Tensor:
    """Paged decompressed-MLA prefill attention.

    q [B, T, H, nope + rope] (float32/bfloat16/float16; q_pe rotated): the chunk's queries, sequence b's first
    n_new[b] real; pool [pages · page_tokens, latent + rope] (float32/bfloat16/float16, or float8_e4m3fn with
    `kv_scale`: value = fp8 · scale); page_tables int32 [B, max_pages]; lengths int32 [B] (positions held, the new
    ones included and already in the pool); n_new int32 [B]; wkv [H · (nope + v), latent] in q's dtype (kv_b,
    dequantized) -> o [B, T, H, v] in q's dtype, 0 for padding queries. `max_positions` bounds the context
    decompressed (default: the tables' capacity; no host sync either way).

    With `new` [B, T, latent + rope] in q's dtype (the step's rows as the block graph computes them, not yet
    written): the pool holds the context only, `lengths` counts it, and sequence b's rows new[b, :n_new[b]] follow
    it, decompressed and attended as they are (no kv_scale); the scratch holds context and chunk
    (`max_positions` + T)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, nope + rope], got {tuple(q.shape)}")
    b, n_q, heads, qd = q.shape
    d = pool.shape[-1]
    rope = d - latent_dim
    nope = qd - rope
    if pool.dim() != 2 or rope <= 0:
        raise ValueError(f"pool must be [rows, {latent_dim} + rope], got {tuple(pool.shape)}")
    if pool.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise TypeError(f"pool must be float32, bfloat16, float16 or float8_e4m3fn, got {pool.dtype}")
    for name, v in (("latent", latent_dim), ("rope", rope), ("nope", nope), ("v", v_head_dim),
                    ("block_m", config.block_m), ("block_n", config.block_n)):
        _pow2(f"{name} width", v)
    n_cols = heads * (nope + v_head_dim)
    if wkv.shape != (n_cols, latent_dim) or wkv.dtype != q.dtype:
        raise ValueError(f"wkv must be {q.dtype} [{n_cols}, {latent_dim}], got {wkv.dtype} {tuple(wkv.shape)}")
    if page_tables.dim() != 2 or page_tables.shape[0] != b or lengths.shape != (b,) or n_new.shape != (b,):
        raise ValueError(f"page_tables must be [{b}, max_pages], lengths and n_new [{b}], got "
                         f"{tuple(page_tables.shape)}, {tuple(lengths.shape)}, {tuple(n_new.shape)}")
    if latent_dim % config.decompress_k:
        raise ValueError(f"latent width {latent_dim} is not a multiple of the decompression step "
                         f"{config.decompress_k}")
    check_new(new, q, d)
    o = checked_out(out, (b, n_q, heads, v_head_dim), q.dtype, q.device)
    if b == 0 or n_q == 0 or heads == 0:
        return o
    scale = pool_scale(pool, kv_scale, q.device)
    max_pages = page_tables.shape[1]
    p_cap = max_pages * page_tokens if max_positions is None else min(max_positions, max_pages * page_tokens)
    p_cap = max(p_cap, 1) + (0 if new is None else n_q)
    q, pool, wkv = q.contiguous(), pool.contiguous(), wkv.contiguous()
    tables = page_tables.to(torch.int32).contiguous()
    lens = lengths.to(torch.int32).contiguous()
    news = n_new.to(torch.int32).contiguous()
    rows_new = q if new is None else new.contiguous()  # unread without `new`
    kv = torch.empty(b, p_cap, n_cols, dtype=q.dtype, device=q.device)  # the plugin's workspace
    prefill_decompress(pool, scale, tables, lens, news, rows_new, wkv, kv, page_tokens=page_tokens,
                       latent_dim=latent_dim, config=config, has_new=new is not None)
    prefill_attend(q, pool, scale, tables, lens, news, rows_new, kv, o, softmax_scale=softmax_scale,
                   page_tokens=page_tokens, latent_dim=latent_dim, config=config, has_new=new is not None)
    return o


def prefill_decompress(pool, kv_scale, page_tables, lengths, n_new, new, wkv, kv, *, page_tokens: int,
                       latent_dim: int = KV_LORA_RANK, config: MlaPrefillConfig = DEFAULT_CONFIG,
                       has_new: bool = True) -> None:
    """The decompression kernel alone (the MlaDecompress plugin's JIT body): every position of each sequence
    through wkv into kv [B, P, H · (nope + v)] (P positions: its scratch), in kv's dtype; arguments contiguous."""
    b, p_cap, n_cols = kv.shape
    if b == 0 or p_cap == 0:
        return
    grid = (b, triton.cdiv(p_cap, config.decompress_p), triton.cdiv(n_cols, config.decompress_n))
    decompress_kernel[grid](
        pool, kv_scale, page_tables, lengths, n_new, new, wkv, new.shape[1], page_tables.shape[1],
        max(1, pool.shape[0] // page_tokens), p_cap, n_cols, kv,
        D=pool.shape[-1], DL=latent_dim, PAGE=page_tokens, BLOCK_P=config.decompress_p,
        BLOCK_N=config.decompress_n, BLOCK_K=config.decompress_k, HAS_NEW=has_new,
        **math_constexprs(kv.dtype, pool.dtype), num_warps=config.decompress_warps, enable_fp_fusion=FP_FUSION)


def prefill_attend(q, pool, kv_scale, page_tables, lengths, n_new, new, kv, o, *, softmax_scale: float,
                   page_tokens: int, latent_dim: int = KV_LORA_RANK, config: MlaPrefillConfig = DEFAULT_CONFIG,
                   has_new: bool = True) -> None:
    """The attention kernel alone (the MlaAttend plugin's JIT body): o [B, T, H, v] from the queries, the
    decompressed rows kv and the rope keys where they lie; arguments contiguous."""
    b, n_q, heads, qd = q.shape
    d = pool.shape[-1]
    rope = d - latent_dim
    v = o.shape[-1]
    if b == 0 or n_q == 0 or heads == 0:
        return
    attend_kernel[(b, heads, triton.cdiv(n_q, config.block_m))](
        q, pool, kv_scale, page_tables, lengths, n_new, new, kv, n_q, page_tables.shape[1],
        max(1, pool.shape[0] // page_tokens), kv.shape[1], o,
        H=heads, NOPE=qd - rope, DR=rope, DV=v, D=d, DL=latent_dim, PAGE=page_tokens, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, SM_SCALE=float(softmax_scale), HAS_NEW=has_new,
        **math_constexprs(q.dtype, pool.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
        enable_fp_fusion=FP_FUSION)
