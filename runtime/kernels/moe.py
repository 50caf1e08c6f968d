"""Triton MoE for FP8 block-scaled experts: the four stages of MoeFp8 (graphs/contracts.MOE_STAGES), one kernel
each, computed as graphs/moe_ref defines them:

  1. align_kernel: sort the (token, expert) pairs by expert (stable) -> sorted_pairs [n], expert_offsets [E+1];
  2. gate_up_kernel: one grouped GEMM computes gate and up tiles for the same sorted rows (two accumulators); under
     W8A8 it quantizes each 1×128 group of x in registers (same bits as quantizing x first), and its epilogue
     computes SiLU(gate)·up and re-quantizes it to fp8 -> h [n, I], h_scale [n, I/128];
  3. down_kernel: grouped down GEMM, one output row per pair -> pair_out [n, d] in the activation dtype;
  4. combine_kernel: y[t] = Σ_k w[t,k]·pair_out[t·k_top + k] in fp32, cast to the activation dtype.

The grouped GEMMs find their expert from expert_offsets themselves: tile t of a kernel belongs to the expert whose
run of ceil(count/BM) tiles contains it. So the layout does not depend on the tile height, and each GEMM picks
its own BM (a TensorRT tactic each) — the grid is bounded from shapes alone: Σ_e ceil(c_e/BM) ≤
(n + min(n, E)·(BM−1)) / BM, tiles past the total exit at once.

Kernel parameters are in TensorRT's AOT launch order — the node's inputs, the extra int32 scalars, the outputs —
with every static size a constexpr, so the same kernels run from torch (the JIT entry points below) and as AOT
plugins (runtime/aot/moe.py). Nothing syncs with the host. Indices read from data are clamped into range:
TensorRT times plugins on uninitialized inputs, and a stray index must not fault.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, cdiv
from k2trt.runtime.kernels.fp8_linear import (quant_group, round_act, scaled_dot, to_act, act_code,
                                               check_activation_quant, checked_out, dot16, fma_dot, FMA_BLOCK_K,
                                               FP_FUSION)


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def align_kernel(ids_ptr, n, sorted_ptr, off_ptr,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr):
    """One program: count pairs per expert, exclusive offsets by cumsum, then place each pair at its expert's next
    free row, in pair order (rank within a chunk from an equality triangle)."""
    lane = tl.arange(0, CH)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, n, CH):
        m = c0 + lane < n
        e = tl.minimum(tl.maximum(tl.load(ids_ptr + c0 + lane, mask=m, other=0), 0), E - 1)
        counts += tl.histogram(e, BLOCK_E, mask=m)
    starts = tl.cumsum(counts, 0) - counts  # bins >= E are empty: starts[E] = n
    idx = tl.arange(0, BLOCK_E)
    tl.store(off_ptr + idx, starts, mask=idx <= E)
    nxt = starts
    earlier = lane[None, :] < lane[:, None]
    for c0 in range(0, n, CH):
        m = c0 + lane < n
        e = tl.minimum(tl.maximum(tl.load(ids_ptr + c0 + lane, mask=m, other=0), 0), E - 1)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier & m[None, :]).to(tl.int32), axis=1)
        tl.store(sorted_ptr + tl.gather(nxt, e, 0) + rank, c0 + lane, mask=m)
        nxt += tl.histogram(e, BLOCK_E, mask=m)


@triton.jit
def expert_tile(off_ptr, pid_m, n, E: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert of row tile pid_m and the tile's sorted rows [start, stop). e >= E: past the last tile."""
    idx = tl.arange(0, BLOCK_E)
    lo = tl.minimum(tl.maximum(tl.load(off_ptr + idx, mask=idx < E, other=0), 0), n)
    hi = tl.minimum(tl.maximum(tl.load(off_ptr + idx + 1, mask=idx < E, other=0), lo), n)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)
    e = tl.sum((ends <= pid_m).to(tl.int32))
    mine = idx == e
    start = tl.sum(tl.where(mine, lo, 0)) + (pid_m - tl.sum(tl.where(mine, ends - tiles, 0))) * BM
    stop = tl.sum(tl.where(mine, hi, 0))
    return e, start, stop


@triton.jit
def gate_up_kernel(x_ptr, sorted_ptr, off_ptr, gw_ptr, gs_ptr, uw_ptr, us_ptr, M, n, h_ptr, hs_ptr,
                    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, BLOCK_E: tl.constexpr, A_FP8: tl.constexpr, ACT: tl.constexpr,
                    DOT16: tl.constexpr):
    # N fastest: the row tile's activations stay hot while the expert's gate/up weight tiles stream past
    KB: tl.constexpr = (K + 127) // 128
    NB: tl.constexpr = (N + 127) // 128
    pid = tl.program_id(0)
    num_n: tl.constexpr = (N + BN - 1) // BN
    pid_m = pid // num_n
    pid_n = pid % num_n
    e, start, stop = expert_tile(off_ptr, pid_m, n, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = start + tl.arange(0, BM)
    valid = rows < stop
    top_k = tl.maximum(n // tl.maximum(M, 1), 1)
    pair = tl.minimum(tl.maximum(tl.load(sorted_ptr + rows, mask=valid, other=0), 0), n - 1)
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    a_ptrs = x_ptr + tok[:, None] * K + offs_k[None, :]
    w_off = e.to(tl.int64) * N * K + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    g_ptrs = gw_ptr + w_off
    u_ptrs = uw_ptr + w_off
    s_off = e * NB * KB + (offs_n // 128) * KB
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a_mask = valid[:, None]
            b_mask = n_mask[None, :]
        else:
            k_ok = offs_k < K - k0
            a_mask = valid[:, None] & k_ok[None, :]
            b_mask = n_mask[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        bg = tl.load(g_ptrs, mask=b_mask, other=0.0)
        bu = tl.load(u_ptrs, mask=b_mask, other=0.0)
        sg = tl.load(gs_ptr + s_off + k0 // 128, mask=n_mask, other=0.0)
        su = tl.load(us_ptr + s_off + k0 // 128, mask=n_mask, other=0.0)
        a_s = sg  # unused unless A_FP8
        if A_FP8:
            q, a_s = quant_group(a.to(tl.float32))  # one 1x128 group per row: BK == 128
            a = q.to(tl.float8e4nv)
        acc_g = scaled_dot(a, a_s, bg, sg, acc_g, A_FP8, ACT, DOT16)
        acc_u = scaled_dot(a, a_s, bu, su, acc_u, A_FP8, ACT, DOT16)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    # the reference rounds gate, up, silu(gate) and the product to x's dtype; torch's silu is x / (1 + exp(-x))
    g = round_act(acc_g, ACT)
    u = round_act(acc_u, ACT)
    h = round_act(round_act(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ACT) * u, ACT)
    rows64 = rows.to(tl.int64)
    h_ptrs = h_ptr + rows64[:, None] * N + offs_n[None, :]
    if A_FP8:
        q, s = quant_group(h)  # BN == 128: this tile is exactly one 1×128 group per row (I % 128 == 0)
        tl.store(h_ptrs, q.to(tl.float8e4nv), mask=valid[:, None] & n_mask[None, :])
        tl.store(hs_ptr + rows64 * NB + pid_n, s, mask=valid)
    else:
        tl.store(h_ptrs, to_act(h, ACT), mask=valid[:, None] & n_mask[None, :])
        tl.store(hs_ptr + rows64 * NB + pid_n, tl.full((BM,), 1.0, tl.float32), mask=valid)  # BN == 128


@triton.jit
def down_kernel(h_ptr, hs_ptr, sorted_ptr, off_ptr, w_ptr, s_ptr, n, out_ptr,
                 E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, BLOCK_E: tl.constexpr, A_FP8: tl.constexpr, ACT: tl.constexpr,
                 DOT16: tl.constexpr):
    KB: tl.constexpr = (K + 127) // 128
    NB: tl.constexpr = (N + 127) // 128
    pid = tl.program_id(0)
    num_n: tl.constexpr = (N + BN - 1) // BN
    pid_m = pid // num_n
    pid_n = pid % num_n
    e, start, stop = expert_tile(off_ptr, pid_m, n, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = start + tl.arange(0, BM)
    valid = rows < stop
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    a_ptrs = h_ptr + rows64[:, None] * K + offs_k[None, :]  # h rows are the sorted rows MoeGateUp wrote
    as_ptrs = hs_ptr + rows64 * KB
    b_ptrs = w_ptr + e.to(tl.int64) * N * K + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    s_ptrs = s_ptr + e * NB * KB + (offs_n // 128) * KB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :] & k_ok[:, None], other=0.0)
        b_s = tl.load(s_ptrs + k0 // 128, mask=n_mask, other=0.0)
        a_s = b_s  # unused unless A_FP8
        if A_FP8:
            a_s = tl.load(as_ptrs + k0 // 128, mask=valid, other=0.0)
        acc = scaled_dot(a, a_s, b, b_s, acc, A_FP8, ACT, DOT16)
        a_ptrs += BK
        b_ptrs += BK
    pair = tl.minimum(tl.maximum(tl.load(sorted_ptr + rows, mask=valid, other=0), 0), n - 1).to(tl.int64)
    tl.store(out_ptr + pair[:, None] * N + offs_n[None, :], to_act(acc, ACT), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def combine_kernel(o_ptr, w_ptr, y_ptr, D: tl.constexpr, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    ACT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j)
        v = tl.load(o_ptr + (t * TOP_K + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
        acc += v * w
    tl.store(y_ptr + t * D + offs, to_act(acc, ACT), mask=mask)


# ---------------------------------------------------------------------------------------------- launch rules
# Shared by the torch entry points below and the AOT plans (runtime/aot/moe.py): grids work on ints and on
# TensorRT shape expressions (only + - * // and the `minimum` given).

@dataclass(frozen=True)
class GemmTiles:
    """Tiles of a grouped GEMM (gate+up or down): one TensorRT tactic each."""
    block_m: int
    block_n: int = 128  # gate+up: must be 128, one re-quantization group per tile
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = BLOCK  # divides 128 (one weight scale per 128 K); W8A8: 128, one activation group per K step


# tactic id -> tiles. Decode has ~1 pair per touched expert, so a 16-row tile wastes little; prefill fills 64-row
# tiles. 32- and 64-row tiles take 8 warps: the two gate/up accumulators spill with 4 (ptxas, sm_90).
GEMM_TACTICS: dict[int, GemmTiles] = {
    1: GemmTiles(block_m=16, num_stages=3),
    2: GemmTiles(block_m=32, num_warps=8, num_stages=4),
    3: GemmTiles(block_m=64, num_warps=8, num_stages=3),
}
# float32 W8A16 dots run on FMA units (fp8_linear.fma_dot): their operand tiles are fp32, four times an fp8 tile, and
# at K steps of 128 two of them (gate and up, 128x128) alone need 128 KiB — no height or stage count fits the 48 KiB
# of an AOT launch (runtime/aot/ptx.py; the smallest, BM 16 with one stage, needs 73,728 B). At fp8_linear's
# FMA_BLOCK_K every tactic keeps its height and pipelining, unspilled (tests/test_aot_compile.py).
# (max average pairs per expert, tactic) for the torch entry point, which picks without timing
_TACTIC_BY_LOAD = ((4.0, 1), (24.0, 2), (float("inf"), 3))
ALIGN_WARPS = 2
COMBINE_BLOCK_D = 1024


def default_tactic(num_pairs: int, num_experts: int) -> int:
    avg = num_pairs / max(1, num_experts)
    return next(t for limit, t in _TACTIC_BY_LOAD if avg <= limit)


def gemm_tiles_bound(num_pairs, num_experts: int, block_m: int, minimum=min):
    """Row tiles a grouped GEMM launches: ≥ Σ_e ceil(count_e / block_m) for any routing."""
    return (num_pairs + minimum(num_pairs, num_experts) * (block_m - 1) + block_m - 1) // block_m


def gemm_grid(num_pairs, num_experts: int, out_cols: int, tiles: GemmTiles, minimum=min):
    return gemm_tiles_bound(num_pairs, num_experts, tiles.block_m, minimum) * cdiv(out_cols, tiles.block_n)


def align_constexprs(num_experts: int) -> dict:
    """tl.histogram's GPU lowering counts every copy of an input element that the layout replicates across warps,
    so each histogram input must have at least one element per thread: CH = 32 · warps, BLOCK_E >= CH. BLOCK_E
    also holds the E + 1 offsets; histogram inputs lie in [0, E)."""
    ch = 32 * ALIGN_WARPS
    return dict(E=num_experts, BLOCK_E=max(ch, triton.next_power_of_2(num_experts + 1)), CH=ch)


def gemm_constexprs(num_experts: int, out_cols: int, in_cols: int, tiles: GemmTiles, activation_quant: int,
                    dtype: torch.dtype) -> dict:
    """dtype: the activation dtype (x's for gate+up, pair_out's for down)."""
    return dict(E=num_experts, N=out_cols, K=in_cols, BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k,
                BLOCK_E=triton.next_power_of_2(num_experts + 1), A_FP8=activation_quant == PER_TOKEN_GROUP,
                ACT=act_code(dtype), DOT16=dot16(dtype))


def combine_constexprs(d: int, top_k: int, dtype: torch.dtype) -> dict:
    return dict(D=d, TOP_K=top_k, BLOCK_D=COMBINE_BLOCK_D, ACT=act_code(dtype))


def check_gemm(tiles: GemmTiles, gate_up: bool, activation_quant: int = PER_TOKEN_GROUP) -> None:
    if gate_up and tiles.block_n != BLOCK:
        raise ValueError("the gate+up GEMM needs block_n == 128 (one scale group of h per tile)")
    if BLOCK % tiles.block_k or (activation_quant == PER_TOKEN_GROUP and tiles.block_k != BLOCK):
        raise ValueError(f"block_k {tiles.block_k} must divide 128 (one weight scale per 128 K), and be 128 under "
                         "W8A8 (one activation group per K step)")


def gemm_tiles(stage: str, tactic: int, dtype: torch.dtype, activation_quant: int) -> GemmTiles:
    """The tiles of a tactic for the "gate_up" or "down" GEMM in an activation dtype and FP8 mode, checked for that
    stage: the torch entry points and the AOT launches (runtime/aot/moe.py) both take them from here."""
    if tactic not in GEMM_TACTICS:
        raise ValueError(f"MoE {stage}: unknown tactic {tactic}; expected one of {sorted(GEMM_TACTICS)}")
    tiles = GEMM_TACTICS[tactic]
    if fma_dot(dtype, activation_quant):
        tiles = replace(tiles, block_k=FMA_BLOCK_K)
    check_gemm(tiles, gate_up=stage == "gate_up", activation_quant=activation_quant)
    return tiles


# ---------------------------------------------------------------------------------------------- entry points

def _check_weights(gate_w, up_w, down_w, d: int) -> tuple[int, int]:
    num_experts, inter, dg = gate_w.shape
    if dg != d or up_w.shape != gate_w.shape or down_w.shape != (num_experts, d, inter):
        raise ValueError(f"shapes do not match: d={d}, gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, "
                         f"down {tuple(down_w.shape)}")
    for name, w in (("gate", gate_w), ("up", up_w), ("down", down_w)):
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} weight must be float8_e4m3fn, got {w.dtype}")
    return num_experts, inter


def moe_align(topk_ids: torch.Tensor, num_experts: int, sorted_pairs=None, expert_offsets=None):
    """Stage 1: topk_ids [.., k] int32 -> (sorted_pairs int32 [n], expert_offsets int32 [E + 1])."""
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    sorted_pairs = checked_out(sorted_pairs, (n,), torch.int32, flat.device)
    expert_offsets = checked_out(expert_offsets, (num_experts + 1,), torch.int32, flat.device)
    align_kernel[(1,)](flat, n, sorted_pairs, expert_offsets, **align_constexprs(num_experts),
                        num_warps=ALIGN_WARPS, enable_fp_fusion=FP_FUSION)
    return sorted_pairs, expert_offsets


def moe_gate_up(x2, sorted_pairs, expert_offsets, gate_w, gate_s, up_w, up_s, activation_quant: int,
                tactic: int | None = None, h=None, h_scale=None):
    """Stage 2: x2 [M, d] -> (h [n, I] fp8 (W8A8) or x's dtype, h_scale float32 [n, ceil(I/128)])."""
    check_activation_quant(activation_quant)
    m, d = x2.shape
    num_experts, inter, _ = gate_w.shape
    n = sorted_pairs.numel()
    tiles = gemm_tiles("gate_up", tactic or default_tactic(n, num_experts), x2.dtype, activation_quant)
    w8a8 = activation_quant == PER_TOKEN_GROUP
    h = checked_out(h, (n, inter), torch.float8_e4m3fn if w8a8 else x2.dtype, x2.device)
    h_scale = checked_out(h_scale, (n, cdiv(inter, BLOCK)), torch.float32, x2.device)
    if n:
        gate_up_kernel[(gemm_grid(n, num_experts, inter, tiles),)](
            x2.contiguous(), sorted_pairs, expert_offsets, gate_w.contiguous(), gate_s.float().contiguous(),
            up_w.contiguous(), up_s.float().contiguous(), m, n, h, h_scale,
            **gemm_constexprs(num_experts, inter, d, tiles, activation_quant, x2.dtype),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)
    return h, h_scale


def moe_down(h, h_scale, sorted_pairs, expert_offsets, down_w, down_s, activation_quant: int, dtype: torch.dtype,
             tactic: int | None = None, out=None):
    """Stage 3: h, h_scale (from moe_gate_up) -> pair_out [n, d] in `dtype` (the activation dtype), pair order."""
    check_activation_quant(activation_quant)
    num_experts, d, inter = down_w.shape
    n = sorted_pairs.numel()
    tiles = gemm_tiles("down", tactic or default_tactic(n, num_experts), dtype, activation_quant)
    out = checked_out(out, (n, d), dtype, h.device)
    if n:
        down_kernel[(gemm_grid(n, num_experts, d, tiles),)](
            h, h_scale, sorted_pairs, expert_offsets, down_w.contiguous(), down_s.float().contiguous(), n, out,
            **gemm_constexprs(num_experts, d, inter, tiles, activation_quant, dtype),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION)
    return out


def moe_combine(pair_out, topk_weights, out=None):
    """Stage 4: y [M, d] = Σ_k w[t, k] · pair_out[t·k_top + k], fp32 sum, in pair_out's dtype."""
    top_k = topk_weights.shape[-1]
    w = topk_weights.reshape(-1, top_k).float().contiguous()
    m, d = w.shape[0], pair_out.shape[1]
    out = checked_out(out, (m, d), pair_out.dtype, pair_out.device)
    if m:
        combine_kernel[(m, cdiv(d, COMBINE_BLOCK_D))](pair_out, w, out, **combine_constexprs(d, top_k, out.dtype),
                                                     enable_fp_fusion=FP_FUSION)
    return out


def moe_fp8(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s,
            activation_quant: int = PER_TOKEN_GROUP, out: torch.Tensor | None = None,
            tactic: int | None = None) -> torch.Tensor:
    """The MoeFp8 contract: x [..., d] fp32/bf16/fp16; topk_ids int [..., k]; topk_weights fp32 [..., k];
    gate/up fp8 [E, I, d], down fp8 [E, d, I] with fp32 128×128 block scales -> y [..., d] in x's dtype."""
    check_activation_quant(activation_quant)
    d = x.shape[-1]
    num_experts, inter = _check_weights(gate_w, up_w, down_w, d)
    if activation_quant == PER_TOKEN_GROUP and (d % BLOCK or inter % BLOCK):
        raise ValueError(f"W8A8 MoE needs d and I multiples of {BLOCK}, got d={d}, I={inter}")
    def gemms(x2, sorted_pairs, offsets):
        h, hs = moe_gate_up(x2, sorted_pairs, offsets, gate_w, gate_s, up_w, up_s, activation_quant, tactic)
        return moe_down(h, hs, sorted_pairs, offsets, down_w, down_s, activation_quant, x.dtype, tactic)

    return run_stages(x, topk_ids, topk_weights, num_experts, gemms, out)


def run_stages(x, topk_ids, topk_weights, num_experts: int, gemms, out=None) -> torch.Tensor:
    """A MoE node as its stages: align, gemms(x2, sorted_pairs, expert_offsets) -> pair_out (the grouped GEMMs of
    its weight format), combine -> y in x's shape and dtype."""
    act_code(x.dtype)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = checked_out(out, tuple(x.shape), x.dtype, x.device)
    if x2.shape[0] == 0:
        return out
    sorted_pairs, offsets = moe_align(topk_ids, num_experts)
    pair_out = gemms(x2, sorted_pairs, offsets)
    moe_combine(pair_out, topk_weights.reshape(x2.shape[0], -1), out=out.view(x2.shape[0], d))
    return out
