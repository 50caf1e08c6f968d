"""Triton MoE for INT4 group-quantized experts (W4A16): the two GEMM stages of MoeInt4 (graphs/contracts.py:
MoeGateUpInt4, MoeDownInt4), computed as graphs/moe_ref / graphs/int4 define them. The align and combine stages are
the FP8 MoE's own kernels (runtime/kernels/moe.py), and so is the way a row tile finds its expert.

Inner loop (the shape of vLLM's fused_moe W4A16 kernel): a [BK, BN] weight tile is read as the [BK/8, BN] int32
words that hold it, each once — word k // 8 of row n, the value at bits 4·(k % 8) — with one scale per word (row n,
group k // g: g is a multiple of 8), then unpacked in registers: shifted, masked and offset (q = nibble - 8), times
its scale, rounded to bf16 as the checkpoint's weight is (W = bf16(q·s)), and multiplied with the activation
tile as int4_dot_mode says: on tensor cores where one operand type holds both exactly (bf16 activations: bf16;
fp16: tf32), so the products are exact and accumulate in fp32 as the reference's fp32 matmul does, on FMA units in
fp32 for fp32 activations. Activations are never quantized. Nothing syncs with the host; indices read from data are
clamped, as in moe.py.

Kernel parameters are in TensorRT's AOT launch order — the node's inputs, the extra int32 scalars, the outputs —
with every static size a constexpr, so the same kernels run from torch (the entry points below) and as AOT plugins
(runtime/aot/moe_int4.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k2trt.graphs.int4 import PACK_FACTOR
from k2trt.runtime.kernels.fp8_linear import (FMA_BLOCK_K, FMA_MAX_TILE, FP_FUSION, act_code, checked_out,
                                               interpreting, rne_bf16, round_act, to_act)
from k2trt.runtime.kernels.moe import expert_tile, gemm_tiles_bound, run_stages


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def row_tile(off_ptr, n, E: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BLOCK_E: tl.constexpr):
    """This program's tile of a grouped GEMM: (expert, sorted rows [BM] and their mask, output columns [BN] and
    their mask), N fastest; expert >= E past the last tile (moe.py's expert_tile)."""
    pid = tl.program_id(0)
    num_n: tl.constexpr = (N + BN - 1) // BN
    e, start, stop = expert_tile(off_ptr, pid // num_n, n, E, BM, BLOCK_E)
    rows = start + tl.arange(0, BM)
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    return e, rows, rows < stop, offs_n, offs_n < N


@triton.jit
def int4_tile(w_ptr, s_ptr, e, offs_n, n_mask, k0, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """Expert e's weight W[n, k] for k in [k0, k0 + BK), n in offs_n [BN], as a [BK, BN] fp32 tile of bf16(q·s).
    Each int32 word (8 values of k, one group: G is a multiple of 8) is loaded once with its scale and unpacked in
    registers, so a K step reads BK / 8 words per column, not BK copies of them."""
    words: tl.constexpr = K // 8
    groups: tl.constexpr = K // G
    BW: tl.constexpr = BK // 8
    ww = k0 // 8 + tl.arange(0, BW)  # the step's words [BW]
    rows = e.to(tl.int64) * N + offs_n[None, :].to(tl.int64)  # [1, BN]
    mask = n_mask[None, :] & (ww < words)[:, None]  # [BW, BN]
    packed = tl.load(w_ptr + rows * words + ww[:, None], mask=mask, other=0)  # int32 [BW, BN]
    s = tl.load(s_ptr + rows * groups + (ww * 8 // G)[:, None], mask=mask, other=0.0).to(tl.float32)
    q = ((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF) - 8  # [BW, 8, BN]: k = 8·word + i
    return tl.reshape(rne_bf16(q.to(tl.float32) * s[:, None, :]), (BK, BN))


@triton.jit
def a_tile(ptr, rows64, valid, k0, K: tl.constexpr, BK: tl.constexpr):
    """Activation rows [BM] (int64 indices) at K step k0: the [BM, BK] tile."""
    kk = k0 + tl.arange(0, BK)
    return tl.load(ptr + rows64[:, None] * K + kk[None, :], mask=valid[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def int4_dot(a, w, acc, DOT: tl.constexpr):
    """acc += a [BM, BK] · w [BK, BN] (w: fp32 holding bf16 values) in the mode DOT (int4_dot_mode): 1 bf16 tensor
    cores, 2 tf32 tensor cores (a holds fp16 values: both operands exact in tf32), 0 fp32 FMA units."""
    if DOT == 1:
        acc = tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)
    elif DOT == 2:
        acc = tl.dot(a.to(tl.float32), w, acc, input_precision="tf32")
    else:
        acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
    return acc


@triton.jit
def gate_up_int4_kernel(x_ptr, sorted_ptr, off_ptr, gp_ptr, gs_ptr, up_ptr, us_ptr, M, n, h_ptr,
                        E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, ACT: tl.constexpr,
                        DOT: tl.constexpr):
    e, rows, valid, offs_n, n_mask = row_tile(off_ptr, n, E, N, BM, BN, BLOCK_E)
    if e >= E:
        return
    top_k = tl.maximum(n // tl.maximum(M, 1), 1)
    pair = tl.minimum(tl.maximum(tl.load(sorted_ptr + rows, mask=valid, other=0), 0), n - 1)
    tok = (pair // top_k).to(tl.int64)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_tile(x_ptr, tok, valid, k0, K, BK)
        acc_g = int4_dot(a, int4_tile(gp_ptr, gs_ptr, e, offs_n, n_mask, k0, N, K, G, BN, BK), acc_g, DOT)
        acc_u = int4_dot(a, int4_tile(up_ptr, us_ptr, e, offs_n, n_mask, k0, N, K, G, BN, BK), acc_u, DOT)
    # the reference rounds gate, up, silu(gate) and the product to x's dtype; torch's silu is x / (1 + exp(-x))
    g = round_act(acc_g, ACT)
    u = round_act(acc_u, ACT)
    h = round_act(round_act(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ACT) * u, ACT)
    rows64 = rows.to(tl.int64)
    tl.store(h_ptr + rows64[:, None] * N + offs_n[None, :], to_act(h, ACT), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def down_int4_kernel(h_ptr, sorted_ptr, off_ptr, dp_ptr, ds_ptr, n, out_ptr,
                     E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, ACT: tl.constexpr,
                     DOT: tl.constexpr):
    e, rows, valid, offs_n, n_mask = row_tile(off_ptr, n, E, N, BM, BN, BLOCK_E)
    if e >= E:
        return
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_tile(h_ptr, rows.to(tl.int64), valid, k0, K, BK)
        acc = int4_dot(a, int4_tile(dp_ptr, ds_ptr, e, offs_n, n_mask, k0, N, K, G, BN, BK), acc, DOT)
    pair = tl.minimum(tl.maximum(tl.load(sorted_ptr + rows, mask=valid, other=0), 0), n - 1).to(tl.int64)
    tl.store(out_ptr + pair[:, None] * N + offs_n[None, :], to_act(acc, ACT), mask=valid[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------- launch rules
# Shared by the torch entry points below and the AOT launches (runtime/aot/moe_int4.py).

@dataclass(frozen=True)
class Int4Tiles:
    """Tiles of an INT4 grouped GEMM: one TensorRT tactic each. block_k: a whole number of int32 words."""
    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# tactic id -> tiles for 16-bit activations (tensor-core dots): decode (about one pair per touched expert) wants
# short row tiles, prefill fills 64 rows. The 64x128 tile steps K by 32: at 64 its gate+up stages need 57,344 B
# (bf16) / 65,536 B (fp16, tf32 operands) at 3 stages, over the 48 KiB of an AOT launch (runtime/aot/ptx.py).
INT4_TACTICS: dict[int, Int4Tiles] = {
    1: Int4Tiles(block_m=16),
    2: Int4Tiles(block_m=32, num_warps=4, num_stages=4),
    3: Int4Tiles(block_m=64, block_n=128, block_k=32, num_warps=8, num_stages=3),
}
_TACTIC_BY_LOAD = ((4.0, 1), (24.0, 2), (float("inf"), 3))

# dot modes (the kernels' DOT constexpr)
DOT_FMA, DOT_BF16, DOT_TF32 = 0, 1, 2


def int4_dot_mode(dtype: torch.dtype) -> int:
    """How an activation dtype multiplies the bf16-valued weights. bf16: bf16 tensor cores. fp16: tf32 tensor cores
    — an fp16 value (11 significant bits, 5 exponent bits) and a bf16 one (8, 8) are both exact in tf32 (11, 8), so
    the products are exact as in bf16, while an fp16 dot would round a bf16 weight outside fp16's range or below its
    normals; Triton hands the wgmma the fp32 bits unrounded, and the tf32 unit reads their top 19, which hold those
    values whole. fp32: FMA units in fp32 ("ieee"; tf32 would round the activations). Under the interpreter bf16
    runs as fp32 (its bf16 arithmetic is wrong; the products are the same), and its dot ignores input_precision, so
    tf32 is fp32 there."""
    act_code(dtype)
    if dtype == torch.float32:
        return DOT_FMA
    if dtype == torch.float16:
        return DOT_TF32
    return DOT_FMA if interpreting() else DOT_BF16


def int4_tiles(tactic: int, dtype: torch.dtype) -> Int4Tiles:
    """The tiles of a tactic for an activation dtype: the torch entry points and the AOT launches
    (runtime/aot/moe_int4.py) both take them from here. 16-bit activations take INT4_TACTICS as they are. fp32
    ones dot on FMA units, whose operand tiles live in registers as fp32: at a K step of 64 both GEMMs spilled at
    every tactic (ptxas, sm_90: 300-500 B at 16 rows, 14 KB at 64x128), so they step K by FMA_BLOCK_K and keep
    tiles within FMA_MAX_TILE (64x64), as the FP8 kernels' fp32 W8A16 path does. Every tactic and dtype then fits
    the 48 KiB of an AOT launch as chosen, unspilled (tests/test_aot_compile.py): the JIT and AOT run one tiling."""
    if tactic not in INT4_TACTICS:
        raise ValueError(f"INT4 MoE: unknown tactic {tactic}; expected one of {sorted(INT4_TACTICS)}")
    tiles = INT4_TACTICS[tactic]
    if dtype == torch.float32:  # FMA dots on every target (int4_dot_mode)
        tiles = replace(tiles, block_k=FMA_BLOCK_K, block_n=min(tiles.block_n, FMA_MAX_TILE // tiles.block_m))
    return tiles


def default_int4_tactic(num_pairs: int, num_experts: int) -> int:
    avg = num_pairs / max(1, num_experts)
    return next(t for limit, t in _TACTIC_BY_LOAD if avg <= limit)


def int4_grid(num_pairs, num_experts: int, out_cols: int, tiles: Int4Tiles, minimum=min):
    """Programs of a grouped INT4 GEMM: the row-tile bound of moe.py times the column tiles (ints or TensorRT
    shape expressions)."""
    return gemm_tiles_bound(num_pairs, num_experts, tiles.block_m, minimum) * (
        (out_cols + tiles.block_n - 1) // tiles.block_n)


def int4_constexprs(num_experts: int, out_cols: int, in_cols: int, group_size: int, tiles: Int4Tiles,
                    dtype: torch.dtype) -> dict:
    """dtype: the activation dtype (x's for gate+up, h's for down)."""
    check_int4_shapes(in_cols, group_size, tiles)
    return dict(E=num_experts, N=out_cols, K=in_cols, G=group_size, BM=tiles.block_m, BN=tiles.block_n,
                BK=tiles.block_k, BLOCK_E=triton.next_power_of_2(num_experts + 1), ACT=act_code(dtype),
                DOT=int4_dot_mode(dtype))


def check_int4_shapes(in_cols: int, group_size: int, tiles: Int4Tiles) -> None:
    if group_size <= 0 or group_size % PACK_FACTOR or in_cols % group_size:
        raise ValueError(f"INT4 group size {group_size} must be a multiple of {PACK_FACTOR} dividing the "
                         f"{in_cols} input channels")
    if tiles.block_k % PACK_FACTOR:
        raise ValueError(f"block_k {tiles.block_k} must be a whole number of int32 words")


# ---------------------------------------------------------------------------------------------- entry points

def _check_weights(gp, gs, up, us, dp, ds, d: int, group_size: int) -> tuple[int, int]:
    num_experts, inter, words = gp.shape
    if (words * PACK_FACTOR != d or up.shape != gp.shape or dp.shape != (num_experts, d, inter // PACK_FACTOR)
            or gs.shape != (num_experts, inter, d // group_size) or us.shape != gs.shape
            or ds.shape != (num_experts, d, inter // group_size)):
        raise ValueError(f"INT4 expert shapes do not match d={d}, g={group_size}: gate {tuple(gp.shape)} / "
                         f"{tuple(gs.shape)}, up {tuple(up.shape)} / {tuple(us.shape)}, down {tuple(dp.shape)} / "
                         f"{tuple(ds.shape)}")
    for name, w in (("gate", gp), ("up", up), ("down", dp)):
        if w.dtype != torch.int32:
            raise TypeError(f"{name} weight must be int32 words of packed int4, got {w.dtype}")
    return num_experts, inter


def moe_gate_up_int4(x2, sorted_pairs, expert_offsets, gp, gs, up, us, group_size: int, tactic: int | None = None,
                     h=None):
    """Stage 2: x2 [M, d] -> h [n, I] in x's dtype."""
    m, d = x2.shape
    num_experts, inter, _ = gp.shape
    n = sorted_pairs.numel()
    tiles = int4_tiles(tactic or default_int4_tactic(n, num_experts), x2.dtype)
    h = checked_out(h, (n, inter), x2.dtype, x2.device)
    if n:
        gate_up_int4_kernel[(int4_grid(n, num_experts, inter, tiles),)](
            x2.contiguous(), sorted_pairs, expert_offsets, gp.contiguous(), gs.contiguous(), up.contiguous(),
            us.contiguous(), m, n, h, **int4_constexprs(num_experts, inter, d, group_size, tiles, x2.dtype),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)
    return h


def moe_down_int4(h, sorted_pairs, expert_offsets, dp, ds, group_size: int, tactic: int | None = None, out=None):
    """Stage 3: h [n, I] -> pair_out [n, d] in h's dtype, pair order."""
    num_experts, d, _ = dp.shape
    n, inter = h.shape
    tiles = int4_tiles(tactic or default_int4_tactic(n, num_experts), h.dtype)
    out = checked_out(out, (n, d), h.dtype, h.device)
    if n:
        down_int4_kernel[(int4_grid(n, num_experts, d, tiles),)](
            h, sorted_pairs, expert_offsets, dp.contiguous(), ds.contiguous(), n, out,
            **int4_constexprs(num_experts, d, inter, group_size, tiles, h.dtype),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)
    return out


def moe_int4(x, topk_ids, topk_weights, gp, gs, up, us, dp, ds, group_size: int, out: torch.Tensor | None = None,
             tactic: int | None = None) -> torch.Tensor:
    """The MoeInt4 contract: x [..., d] fp32/bf16/fp16; topk_ids int [..., k]; topk_weights fp32 [..., k];
    gate/up packed int32 [E, I, d/8] with scales [E, I, d/g], down [E, d, I/8] with [E, d, I/g] -> y [..., d]."""
    num_experts, _ = _check_weights(gp, gs, up, us, dp, ds, x.shape[-1], group_size)

    def gemms(x2, sorted_pairs, offsets):
        h = moe_gate_up_int4(x2, sorted_pairs, offsets, gp, gs, up, us, group_size, tactic)
        return moe_down_int4(h, sorted_pairs, offsets, dp, ds, group_size, tactic)

    return run_stages(x, topk_ids, topk_weights, num_experts, gemms, out)
