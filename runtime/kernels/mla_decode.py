"""Triton paged MLA decode attention, absorbed form, reading the latent cache where it lies (no gather).

The attention of graphs/blocks.attention with its cache in pages (runtime/cache/pools.PagedLatentCache): per layer
one pool [pages·page_tokens, 576] whose row holds a position's normalized latent c (kv_lora_rank = 512) and rotated
rope key k_pe (64); a sequence's page table lists its pages in position order, so position p lives in pool row
table[p // page_tokens]·page_tokens + p % page_tokens. Each query row is q_full = [q_nope·W_uk (512), q_pe (64)]
of one (query, head); its score against a position is q_full · row · softmax_scale, and the kernel returns
o_lat = Σ softmax(scores) · c [.., 512], which the caller multiplies by W_uv. The graphs/mla_ref.py reference
defines it densely.

Flash-decoding, in two kernels:

  1. split_kernel, grid (B, row blocks, splits): a sequence's query rows — its Q queries × H heads flattened,
     query-major as q lies in memory, BLOCK_M at a time — against one split of its context: the sequence's
     pages are dealt out in equal runs over the splits (graphs/mla_ref.split_partials_reference; runs of
     steps where a step spans pages), so one long sequence fills the GPU as well as many short ones. Each
     block of BLOCK_N positions (32 by default: half a page) is read once for all BLOCK_M rows — MLA's single
     latent head is what makes a page worth reading once for every head — with an online softmax (running max and sum in fp32, base 2). Out: the split's running max, sum and
     unnormalized weighted sum of c (fp32), or, with one split, o itself;
  2. merge_kernel, grid (B · Q · H): rescales the splits' partials to their common max and divides once.

The Q queries of a sequence are its last Q positions (decode: Q = 1; speculative verify: Q ≤ 8), causal among
themselves: query j attends to positions < len − Q + j + 1, where len counts the Q new ones (already in the pool).
A row with nothing to attend (len = 0: a padded batch entry) gets o = 0.

How a block graph calls it (HAS_NEW): the pool holds the context only and the step's rows — computed inside the
block, written to the pool by the runtime after it — come as a dense [B, Q, 576] input with n_new[b] real per
sequence; the last split attends them after its share of the context, exactly (no kv_scale), causal among
themselves, and queries past n_new[b] get 0. So a TensorRT plugin reads its inputs only (no output aliased to the
pool) and the pool needs no room for rows the step has not committed.

Numerics: scores and softmax in fp32 always. The two dots take their operands in the "math dtype": the query dtype
when the pool holds that dtype or fp8 e4m3 (an e4m3 value is exact in bf16, fp16 and fp32; the per-tensor scale is
applied to the fp32 dot results, value = fp8 · scale), fp32 otherwise. With a 16-bit math dtype the probabilities
are rounded to it for the second dot (FlashMLA's choice: tensor cores; graphs/blocks.py rounds them too), and the
products are exact with fp32 accumulation; fp32 dots are "ieee". Under the interpreter bf16 dots run as fp32 on the
same bf16 values (fp8_linear.dot16: its bf16 arithmetic is wrong), so the CPU tests check the GPU's numbers.

Nothing syncs with the host: the split count is chosen from shapes (or given), never from the lengths' values.
Positions past a sequence's length are never loaded, nor table entries past its pages; lengths are clamped to its
table's capacity and page ids read from the table are clamped into the pool, as moe.py clamps indices read from
data (TensorRT runs a plugin on uninitialized inputs when it times it). softmax_scale is a constexpr (a constant of
the model) and the fp8 scale a one-element float32 tensor, so a launch has only pointers and int32 scalars, as an
AOT plugin needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k2trt.runtime.kernels.fp8_linear import ACT_F32, FP_FUSION, act_code, checked_out, dot16, round_act, to_act

KV_LORA_RANK = 512  # K2's (DeepSeek-V3's) latent width: the attended output's width


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def operand(x, MATH: tl.constexpr, DOT16: tl.constexpr):
    """A loaded tile as a dot operand of the math dtype (a no-op for a tile of that dtype; e4m3 converts exactly):
    16-bit for the tensor cores, or fp32 holding the same values for an "ieee" dot."""
    if DOT16:
        if MATH == 1:
            return x.to(tl.bfloat16)
        else:
            return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def probs_operand(p, MATH: tl.constexpr, DOT16: tl.constexpr):
    """The probabilities (fp32) rounded to the math dtype, nearest even on the GPU and the interpreter alike."""
    if DOT16:
        return to_act(p, MATH)
    else:
        return round_act(p, MATH)


@triton.jit
def mma(a, b, acc, DOT16: tl.constexpr):
    """acc + a · b, fp32 accumulation: a 16-bit tensor-core dot, or fp32 FMA ("ieee", never tf32)."""
    if DOT16:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def online_softmax_step(s, values, m_i, l_i, acc, MATH: tl.constexpr, DOT16: tl.constexpr):
    """One block of scores s [M, N] (base 2, masked to -inf) and its values [N, W] (math dtype) folded into the
    running max m_i, sum l_i and weighted sum acc [M, W] (flash attention's update) -> (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mma(probs_operand(p, MATH, DOT16), values, acc * alpha[:, None], DOT16)
    return m_new, l_i, acc


@triton.jit
def split_kernel(q_ptr, pool_ptr, kv_scale_ptr, table_ptr, len_ptr, new_ptr, n_new_ptr, n_q, max_pages, pool_pages,
                 n_splits, part_acc_ptr, part_ml_ptr, o_ptr,
                 H: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SM_SCALE: tl.constexpr,
                 MATH: tl.constexpr, DOT16: tl.constexpr, OUT: tl.constexpr, DIRECT: tl.constexpr,
                 HAS_NEW: tl.constexpr):
    # n_splits is a runtime scalar (one compiled kernel for every split count), DIRECT = (n_splits == 1);
    # HAS_NEW: the pool holds the context only and the step's rows come dense in new [B, n_q, D], n_new[b] real
    D: tl.constexpr = DL + DR
    b = tl.program_id(0)
    mb = tl.program_id(1)
    split = tl.program_id(2)
    rows_q = n_q * H  # the sequence's query rows: (query j, head h) at row j·H + h
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < rows_q
    # positions held, clamped to what the table can name: a bad length must not read past the table's row
    seq_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), max_pages * PAGE)
    if HAS_NEW:
        n_real = tl.minimum(tl.maximum(tl.load(n_new_ptr + b), 0), n_q)
        # query j < n_real sees the context and new rows 0..j; a padding query sees nothing
        limit = tl.where(rows // H < n_real, seq_len + rows // H + 1, 0)
    else:
        limit = seq_len - n_q + rows // H + 1  # query j sees positions < len - Q + j + 1 (causal among the new)

    # this split's run of position blocks: the sequence's pages dealt out in equal runs (units of a page, or of a
    # step where a step spans pages), so a split past them is empty and, for steps within a page (every AOT tile),
    # which positions a split holds does not depend on the tile
    if BLOCK_N <= PAGE:
        unit = tl.cdiv(seq_len, PAGE)
        unit_blocks = PAGE // BLOCK_N
    else:
        unit = tl.cdiv(seq_len, BLOCK_N)
        unit_blocks = 1
    per_split = tl.cdiv(unit, n_splits) * unit_blocks
    blk_lo = split * per_split
    blk_hi = tl.minimum(blk_lo + per_split, tl.cdiv(seq_len, BLOCK_N))

    q_base = q_ptr + b.to(tl.int64) * rows_q * D + rows.to(tl.int64)[:, None] * D
    dl = tl.arange(0, DL)
    dr = DL + tl.arange(0, DR)
    q_lat = operand(tl.load(q_base + dl[None, :], mask=row_ok[:, None], other=0.0), MATH, DOT16)  # [BLOCK_M, DL]
    q_pe = operand(tl.load(q_base + dr[None, :], mask=row_ok[:, None], other=0.0), MATH, DOT16)  # [BLOCK_M, DR]
    kv_scale = tl.load(kv_scale_ptr)  # 1.0 unless the pool is fp8
    qk_scale = kv_scale * (SM_SCALE * 1.4426950408889634)  # scores in base 2: exp2 is the GPU's native exp

    # the running max starts finite (-1e30), so a row that has seen only masked scores (-inf) gets p = 2^-inf = 0
    # and alpha = 1 rather than NaN, and leaves m = -1e30, l = 0, acc = 0 for the merge
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DL), tl.float32)
    table = table_ptr + b.to(tl.int64) * max_pages
    for blk in range(blk_lo, blk_hi):
        pos = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        held = pos < seq_len  # never load past the sequence: neither its table's padding nor the pool's rows
        page = tl.load(table + pos // PAGE, mask=held, other=0)
        page = tl.minimum(tl.maximum(page, 0), pool_pages - 1)
        kv = pool_ptr + (page.to(tl.int64) * PAGE + pos % PAGE)[:, None] * D
        c = operand(tl.load(kv + dl[None, :], mask=held[:, None], other=0.0), MATH, DOT16)  # [BLOCK_N, DL]
        k_pe = operand(tl.load(kv + dr[None, :], mask=held[:, None], other=0.0), MATH, DOT16)  # [BLOCK_N, DR]

        s = mma(q_lat, tl.trans(c), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT16)
        s = mma(q_pe, tl.trans(k_pe), s, DOT16) * qk_scale
        # past a row's causal limit, or the pool's length (with HAS_NEW a limit reaches into the step's rows)
        s = tl.where((pos[None, :] < limit[:, None]) & held[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, c, m_i, l_i, acc, MATH, DOT16)

    acc = acc * kv_scale
    if HAS_NEW:
        if split == n_splits - 1:  # the step's rows, once per sequence: exact, in their own dtype, no kv_scale
            sm_scale = SM_SCALE * 1.4426950408889634
            for i0 in range(0, n_real, BLOCK_N):
                i = i0 + tl.arange(0, BLOCK_N)
                ok = i < n_real
                kv = new_ptr + (b.to(tl.int64) * n_q + i.to(tl.int64))[:, None] * D
                c = operand(tl.load(kv + dl[None, :], mask=ok[:, None], other=0.0), MATH, DOT16)
                k_pe = operand(tl.load(kv + dr[None, :], mask=ok[:, None], other=0.0), MATH, DOT16)
                s = mma(q_lat, tl.trans(c), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT16)
                s = mma(q_pe, tl.trans(k_pe), s, DOT16) * sm_scale
                s = tl.where((seq_len + i)[None, :] < limit[:, None], s, float("-inf"))
                m_i, l_i, acc = online_softmax_step(s, c, m_i, l_i, acc, MATH, DOT16)
    if DIRECT:  # one split, the whole context: normalize and write o, no merge
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with nothing to attend: acc = 0, o = 0
        o_rows = o_ptr + b.to(tl.int64) * rows_q * DL + rows.to(tl.int64)[:, None] * DL
        tl.store(o_rows + dl[None, :], to_act(o, OUT), mask=row_ok[:, None])
    else:
        # partials [B, Q·H, n_splits, ...]: a row's splits lie together for the merge
        part = (b.to(tl.int64) * rows_q + rows.to(tl.int64)) * n_splits + split
        tl.store(part_acc_ptr + part[:, None] * DL + dl[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def merge_kernel(part_acc_ptr, part_ml_ptr, n_splits, o_ptr, DL: tl.constexpr, OUT: tl.constexpr):
    """One query row: o = Σ_s acc_s · 2^(m_s − M) / Σ_s l_s · 2^(m_s − M), M = max_s m_s. An empty split has
    m_s = -1e30 and l_s = acc_s = 0: weight 0 beside any real one, and a row with nothing at all gives o = 0."""
    r = tl.program_id(0).to(tl.int64)
    ml = part_ml_ptr + r * n_splits * 2  # (m, l) of split s at 2s, 2s + 1
    m_max = tl.load(ml)
    for s in range(1, n_splits):
        m_max = tl.maximum(m_max, tl.load(ml + s * 2))
    dl = tl.arange(0, DL)
    acc = tl.zeros((DL,), tl.float32)
    l_sum = 0.0
    for s in range(n_splits):
        w = tl.exp2(tl.load(ml + s * 2) - m_max)
        l_sum += tl.load(ml + s * 2 + 1) * w
        acc += tl.load(part_acc_ptr + (r * n_splits + s) * DL + dl) * w
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)  # nothing to attend: acc = 0, o = 0
    tl.store(o_ptr + r * DL + dl, to_act(o, OUT))


# ---------------------------------------------------------------------------------------------- launch rules

@dataclass(frozen=True)
class MlaDecodeConfig:
    """Tiles of the split kernel. The default, 16 query rows by 32 positions (half a page) a step on 8 warps, two
    stages, is SGLang's Triton MLA decode tile (BLOCK_H 16, BLOCK_N 32) and compiles for sm_90 unspilled in every
    math dtype (ptxas -v, Triton 3.9: bf16 106 registers (142 with one split) and 55 KiB of shared memory; fp8
    pool 172 and 52 KiB; fp32 128 and 110 KiB; the merge 34 registers). Wider tiles spill there: 64 × 64
    (FlashMLA's rows, one page) 164 B in bf16 at two stages; 16 × 64 on 4 warps 192 B; 32 × 32 on 8 warps 8 B in
    bf16 (none with an fp8 pool) — the one to time against the default on a GPU, since it reads each page half as
    often. Each of them needs more shared memory than the 48 KiB an AOT (TensorRT plugin) launch gets
    (runtime/aot/ptx.AOT_SHARED_LIMIT): a plugin needs its own, smaller tiles."""
    block_m: int = 16  # query rows (query, head) per program; a power of two ≥ 16 (tl.dot)
    block_n: int = 32  # positions per step, any power of two ≥ 16: pages are looked up per position
    num_warps: int = 8
    num_stages: int = 2
    merge_warps: int = 4


DEFAULT_CONFIG = MlaDecodeConfig()
MAX_SPLITS = 64
SM_COUNT_SM90 = 132  # an H100 SXM's SMs: the split heuristic's count off a GPU (the interpreter)


def math_dtype(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> torch.dtype:
    """The dots' operand dtype: the query's when the pool holds it or fp8 (exact in any of them), else fp32."""
    act_code(q_dtype)
    if pool_dtype == q_dtype or pool_dtype == torch.float8_e4m3fn:
        return q_dtype
    act_code(pool_dtype)
    return torch.float32


def num_splits(batch: int, row_blocks: int, max_positions: int, block_n: int, sm_count: int = SM_COUNT_SM90) -> int:
    """Splits per sequence so that the grid covers the GPU about twice (FlashMLA's get_mla_metadata aims at every
    SM busy), never more than the longest sequence's position blocks (a split past them is empty) or MAX_SPLITS."""
    programs = max(1, batch * row_blocks)
    want = -(-2 * sm_count // programs)
    return max(1, min(want, -(-max(max_positions, 1) // block_n), MAX_SPLITS))


def math_constexprs(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> dict:
    """The constexprs every MLA kernel takes for its numerics: the math dtype's code, whether its dots are 16-bit
    (tensor cores) and the output dtype's code."""
    math = math_dtype(q_dtype, pool_dtype)
    mcode = act_code(math)
    return dict(MATH=mcode, DOT16=mcode != ACT_F32 and dot16(math), OUT=act_code(q_dtype))


def split_constexprs(heads: int, latent_dim: int, rope_dim: int, page_tokens: int, config: MlaDecodeConfig,
                     direct: bool, softmax_scale: float, q_dtype: torch.dtype, pool_dtype: torch.dtype,
                     has_new: bool = False) -> dict:
    return dict(H=heads, DL=latent_dim, DR=rope_dim, PAGE=page_tokens, BLOCK_M=config.block_m,
                BLOCK_N=config.block_n, SM_SCALE=float(softmax_scale), DIRECT=direct, HAS_NEW=has_new,
                **math_constexprs(q_dtype, pool_dtype))


def check_new(new: torch.Tensor | None, q: torch.Tensor, width: int) -> None:
    """The step's dense rows, when given, are [B, T, width] in q's dtype."""
    b, n_q = q.shape[:2]
    if new is not None and (new.shape != (b, n_q, width) or new.dtype != q.dtype):
        raise ValueError(f"new must be {q.dtype} [{b}, {n_q}, {width}], got {new.dtype} {tuple(new.shape)}")


def pool_scale(pool: torch.Tensor, kv_scale, device) -> torch.Tensor:
    """The one-element float32 tensor the kernels scale pool values by: the fp8 pool's kv_scale, else 1."""
    if pool.dtype == torch.float8_e4m3fn:
        if kv_scale is None:
            raise ValueError("an fp8 pool needs its kv_scale")
        return torch.as_tensor(kv_scale, dtype=torch.float32, device=device).reshape(1)
    return torch.ones(1, dtype=torch.float32, device=device)


def _check(q, pool, page_tables, lengths, latent_dim, config):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Q, H, latent + rope], got {tuple(q.shape)}")
    b, _, _, d = q.shape
    if pool.dim() != 2 or pool.shape[1] != d:
        raise ValueError(f"pool must be [rows, {d}], got {tuple(pool.shape)}")
    if pool.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise TypeError(f"pool must be float32, bfloat16, float16 or float8_e4m3fn, got {pool.dtype}")
    if page_tables.dim() != 2 or page_tables.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_tables must be [{b}, max_pages] and lengths [{b}], got "
                         f"{tuple(page_tables.shape)}, {tuple(lengths.shape)}")
    rope = d - latent_dim
    for name, v in (("latent", latent_dim), ("rope", rope), ("block_m", config.block_m), ("block_n", config.block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} width must be a power of two ≥ 16 (tl.arange, tl.dot), got {v}")
    return rope



def mla_decode(q: torch.Tensor, pool: torch.Tensor, page_tables: torch.Tensor, lengths: torch.Tensor,
               softmax_scale: float, kv_scale: torch.Tensor | float | None = None, *, page_tokens: int,
               latent_dim: int = KV_LORA_RANK, splits: int | None = None, max_positions: int | None = None,
               config: MlaDecodeConfig = DEFAULT_CONFIG, out: torch.Tensor | None = None,
               new: torch.Tensor | None = None, n_new: torch.Tensor | None = None) -> torch.Tensor:
    """Paged absorbed-MLA decode attention.

    q [B, Q, H, latent + rope] float32/bfloat16/float16: q_full of the sequences' last Q positions; pool
    [pages · page_tokens, latent + rope] (float32, bfloat16, float16, or float8_e4m3fn with `kv_scale`, one float32
    per tensor: value = fp8 · scale); page_tables int32 [B, max_pages] (anything past a sequence's pages);
    lengths int32 [B] (positions held, the Q new ones included, already written into the pool) -> o [B, Q, H,
    latent] in q's dtype. `splits` per sequence (default: num_splits from the shapes, bounded by `max_positions`,
    by default the tables' capacity — no host sync).

    With `new` [B, Q, latent + rope] in q's dtype (the step's rows as the block graph computes them, not yet
    written): the pool holds the context only, `lengths` counts it, and sequence b's new rows are new[b, :n_new[b]]
    (default all Q) at the positions after it, attended exactly (no kv_scale); queries j ≥ n_new[b] get 0. This is
    how a block reads the pool in place — the runtime writes the rows after the step."""
    rope = _check(q, pool, page_tables, lengths, latent_dim, config)
    b, n_q, heads, d = q.shape
    check_new(new, q, d)
    if n_new is not None and (new is None or n_new.shape != (b,)):
        raise ValueError(f"n_new goes with new and must be [{b}]")
    o = checked_out(out, (b, n_q, heads, latent_dim), q.dtype, q.device)
    if b == 0 or n_q == 0 or heads == 0:
        return o
    scale = pool_scale(pool, kv_scale, q.device)
    row_blocks = triton.cdiv(n_q * heads, config.block_m)
    if splits is None:
        cap = page_tables.shape[1] * page_tokens if max_positions is None else max_positions
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else SM_COUNT_SM90
        splits = num_splits(b, row_blocks, cap, config.block_n, sms)
    if splits < 1:
        raise ValueError(f"splits must be ≥ 1, got {splits}")
    q = q.contiguous()
    pool = pool.contiguous()
    tables = page_tables.to(torch.int32).contiguous()
    lens = lengths.to(torch.int32).contiguous()
    if new is not None:
        new = new.contiguous()
        news = (torch.full((b,), n_q, dtype=torch.int32, device=q.device) if n_new is None
                else n_new.to(torch.int32).contiguous())
    if splits == 1:
        part_acc = part_ml = None  # the split kernel writes o
    else:
        part_acc = torch.empty(b, n_q, heads, splits, latent_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, n_q, heads, splits, 2, dtype=torch.float32, device=q.device)
    _launch_split(q, pool, scale, tables, lens, new, news if new is not None else None, part_acc, part_ml, o,
                  splits, softmax_scale, page_tokens, latent_dim, config)
    if splits > 1:
        decode_merge(part_acc, part_ml, o, config)
    return o


def _launch_split(q, pool, scale, tables, lens, new, n_new, part_acc, part_ml, o, splits, softmax_scale,
                  page_tokens, latent_dim, config):
    """One launch of the split kernel: direct (part_acc None: o written) or split (partials; o may be None).
    A pointer the form never touches is given any tensor."""
    b, n_q, heads, d = q.shape
    direct = part_acc is None
    unused = o if direct else part_acc
    split_kernel[(b, triton.cdiv(n_q * heads, config.block_m), splits)](
        q, pool, scale, tables, lens, q if new is None else new, lens if new is None else n_new, n_q,
        tables.shape[1], max(1, pool.shape[0] // page_tokens), splits, part_acc if not direct else unused,
        part_ml if not direct else unused, o if o is not None else unused,
        **split_constexprs(heads, latent_dim, d - latent_dim, page_tokens, config, direct, softmax_scale, q.dtype,
                           pool.dtype, new is not None),
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=FP_FUSION)


def decode_split(q: torch.Tensor, pool: torch.Tensor, kv_scale: torch.Tensor, page_tables: torch.Tensor,
                 lengths: torch.Tensor, new: torch.Tensor, n_new: torch.Tensor, part_acc: torch.Tensor,
                 part_ml: torch.Tensor, *, softmax_scale: float, page_tokens: int, latent_dim: int = KV_LORA_RANK,
                 config: MlaDecodeConfig = DEFAULT_CONFIG) -> None:
    """The split kernel alone, in its split form, as the MlaDecodeSplit plugin runs it (its JIT body): the
    step's rows dense in `new`; the partials written into part_acc [B, Q, H, S, latent] and part_ml [B, Q, H, S,
    2] (float32, S splits), every argument contiguous on the device. decode_merge finishes it."""
    _check(q, pool, page_tables, lengths, latent_dim, config)
    check_new(new, q, q.shape[-1])
    if q.shape[0] and q.shape[1]:
        _launch_split(q, pool, kv_scale, page_tables, lengths, new, n_new, part_acc, part_ml, None,
                      part_acc.shape[3], softmax_scale, page_tokens, latent_dim, config)


def decode_merge(part_acc: torch.Tensor, part_ml: torch.Tensor, o: torch.Tensor,
                 config: MlaDecodeConfig = DEFAULT_CONFIG) -> None:
    """The merge kernel: o [B, Q, H, latent] (its dtype) from the partials [B, Q, H, S, ...] decode_split wrote."""
    rows = part_acc.shape[0] * part_acc.shape[1] * part_acc.shape[2]
    if rows:
        merge_kernel[(rows,)](part_acc, part_ml, part_acc.shape[3], o, DL=o.shape[-1], OUT=act_code(o.dtype),
                              num_warps=config.merge_warps, enable_fp_fusion=FP_FUSION)
