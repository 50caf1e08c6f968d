"""Triton MoE for FP8 block-scaled experts: the MoeFp8 node contract (graphs/contracts.py), computed as
graphs/moe_ref.moe_fp8_reference defines it, the way vLLM / SGLang / DeepGEMM organise it:

  1. moe_align: sort the (token, expert) pairs by expert and pad every expert's run to a multiple of block_m,
     so each M tile of the grouped GEMMs belongs to one expert;
  2. x is quantized once per token (W8A8), then one grouped GEMM computes gate and up tiles for the same rows
     (two accumulators) with the epilogue SiLU(gate)·up and 1×128 re-quantization to fp8 (W8A8) — h is written
     in the padded-sorted row order;
  3. a grouped down GEMM writes one output row per pair, in x's dtype (as the reference's per-pair outputs);
  4. a combine kernel sums y[t] = Σ_k w[t,k]·out[t·k_top + k] in fp32 and casts to x's dtype.

Nothing here syncs with the host: buffer sizes and grids are bounded from shapes alone (tiles past the padded
total exit at once), so the entry point can be captured in a CUDA graph or called from a TensorRT plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, cdiv
from k2trt.runtime.kernels.fp8_linear import (_quant_group, _round_act, _scaled_dot, _to_act, act_code,
                                               check_activation_quant, dot16, quantize_activation)


# ---------------------------------------------------------------------------------------------- alignment

class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [capacity]: pair id (token·top_k + slot) per padded row; num_pairs = padding
    tile_experts: torch.Tensor  # int32 [capacity / block_m]: expert of each M tile, -1 past the padded total
    num_padded: torch.Tensor  # int32 [1]: rows actually used (Σ_e roundup(count_e, block_m)), on the device
    block_m: int

    @property
    def capacity(self) -> int:
        return self.sorted_ids.numel()


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e roundup(count_e, block_m): only experts with pairs are padded, at most
    min(num_pairs, E) of them, each by < block_m. Rounded up to whole tiles."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return cdiv(bound, block_m) * block_m


ALIGN_TRITON_MAX_PAIRS = 4096  # one-program Triton alignment up to here (decode), torch ops above (prefill)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, method: str = "auto") -> MoeAlignment:
    """Sort the flattened (token, expert) pairs by expert (stable: by token within an expert) and pad each
    expert's run to a multiple of block_m with the sentinel num_pairs. Experts with no pairs get no rows and no
    tiles. method "triton" is one kernel launch (what decode wants: the torch path is ~25 small launches),
    "torch" scales to any size; "auto" picks by size. Both give identical results and never sync the host."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    cap = align_capacity(n, num_experts, block_m)
    if method == "auto":
        method = "triton" if n <= ALIGN_TRITON_MAX_PAIRS else "torch"
    if method == "torch":
        return _align_torch(flat.to(torch.int64), num_experts, block_m, cap)
    if method != "triton":
        raise ValueError(f"method must be auto, triton or torch, got {method!r}")
    dev = flat.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    tile_experts = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](flat.contiguous(), sorted_ids, tile_experts, num_padded, n, num_experts, cap,
                        cap // block_m, **align_meta(num_experts, cap // block_m, block_m))
    return MoeAlignment(sorted_ids, tile_experts, num_padded, block_m)


def align_meta(num_experts: int, num_tiles: int, block_m: int) -> dict:
    """Launch constants of _align_kernel. tl.histogram's GPU lowering counts every copy of an input element that
    the layout replicates across warps, so each histogram input (CH pairs, BLOCK_E run ends) must have at least
    one element per thread: CH = 32 · warps, BLOCK_E >= CH. Histogram inputs must lie in [0, bins)."""
    warps = 2
    ch = 32 * warps
    return dict(BM=block_m, BLOCK_E=max(ch, triton.next_power_of_2(num_experts)),
                BLOCK_T=max(ch, triton.next_power_of_2(num_tiles + 1)), CH=ch, num_warps=warps)


def _align_torch(flat: torch.Tensor, num_experts: int, block_m: int, cap: int) -> MoeAlignment:
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[e_sorted]  # position within its expert
    pos = (ends - padded)[e_sorted] + rank
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    tile_start = torch.arange(0, cap, block_m, device=dev)
    tile_experts = torch.searchsorted(ends, tile_start, right=True)
    tile_experts = torch.where(tile_start < ends[-1], tile_experts, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, tile_experts, ends[-1:].to(torch.int32), block_m)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, tile_e_ptr, n_pad_ptr, n, E, cap, num_tiles,
                  BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, CH: tl.constexpr):
    """One program: count pairs per expert, padded run offsets by cumsum, tile experts, then place each pair at
    its expert's next free row, in token order (rank within a chunk from an equality triangle)."""
    lane = tl.arange(0, CH)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, n, CH):
        m = c0 + lane < n
        e = tl.load(ids_ptr + c0 + lane, mask=m, other=0).to(tl.int32)
        counts += tl.histogram(e, BLOCK_E, mask=m)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(n_pad_ptr, tl.sum(padded))
    # tile t belongs to the number of experts whose run ends at or before it (empty runs included); past the
    # padded total that count is BLOCK_E >= E, i.e. no work
    marks = tl.histogram(tl.minimum(ends // BM, BLOCK_T - 1), BLOCK_T)
    te = tl.cumsum(marks, 0)
    t = tl.arange(0, BLOCK_T)
    tl.store(tile_e_ptr + t, tl.where(te < E, te, -1), mask=t < num_tiles)
    for r0 in range(0, cap, CH):
        tl.store(sorted_ptr + r0 + lane, n, mask=r0 + lane < cap)
    tl.debug_barrier()  # the sentinel fill above is visible before pairs overwrite their rows
    nxt = ends - padded  # next free row of each expert
    earlier = lane[None, :] < lane[:, None]
    for c0 in range(0, n, CH):
        m = c0 + lane < n
        e = tl.load(ids_ptr + c0 + lane, mask=m, other=0).to(tl.int32)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier & m[None, :]).to(tl.int32), axis=1)
        row = tl.gather(nxt, e, 0) + rank
        tl.store(sorted_ptr + row, c0 + lane, mask=m)
        nxt += tl.histogram(e, BLOCK_E, mask=m)


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def _gate_up_kernel(a_ptr, as_ptr, gw_ptr, gs_ptr, uw_ptr, us_ptr, h_ptr, hs_ptr,
                    sorted_ptr, tile_e_ptr, n_pad_ptr, num_pairs, N, K, TOP_K,
                    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_hm, stride_hsm,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    A_FP8: tl.constexpr, ACT: tl.constexpr, DOT16: tl.constexpr, EVEN_K: tl.constexpr):
    # N fastest: the row tile's activations stay hot while the expert's gate/up weight tiles stream past
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BM >= tl.load(n_pad_ptr):
        return
    e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    a_ptrs = a_ptr + tok[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + tok * stride_asm
    w_off = e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    g_ptrs = gw_ptr + w_off
    u_ptrs = uw_ptr + w_off
    s_off = e * stride_se + (offs_n // 128) * stride_sn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
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
            a_s = tl.load(as_ptrs + k0 // 128, mask=valid, other=0.0)
        acc_g = _scaled_dot(a, a_s, bg, sg, acc_g, A_FP8, ACT, DOT16)
        acc_u = _scaled_dot(a, a_s, bu, su, acc_u, A_FP8, ACT, DOT16)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    # the reference rounds gate, up, silu(gate) and the product to x's dtype; torch's silu is x / (1 + exp(-x))
    g = _round_act(acc_g, ACT)
    u = _round_act(acc_u, ACT)
    h = _round_act(_round_act(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ACT) * u, ACT)
    rows64 = rows.to(tl.int64)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + offs_n[None, :]
    if A_FP8:
        q, s = _quant_group(h)  # BN == 128: this tile is exactly one 1×128 group per row
        tl.store(h_ptrs, q.to(tl.float8e4nv))
        tl.store(hs_ptr + rows64 * stride_hsm + pid_n, s)
    else:
        tl.store(h_ptrs, _to_act(h, ACT), mask=n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, tile_e_ptr, n_pad_ptr, num_pairs, N, K,
                 stride_hm, stride_hsm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 A_FP8: tl.constexpr, ACT: tl.constexpr, DOT16: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BM >= tl.load(n_pad_ptr):
        return
    e = tl.load(tile_e_ptr + pid_m).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_mask = offs_n < N
    # h rows are the padded-sorted rows the gate-up kernel wrote (padding rows hold zeros): no gather, no row mask
    a_ptrs = h_ptr + rows64[:, None] * stride_hm + offs_k[None, :]
    as_ptrs = hs_ptr + rows64 * stride_hsm
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + e * stride_se + (offs_n // 128) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :] & k_ok[:, None], other=0.0)
        b_s = tl.load(s_ptrs + k0 // 128, mask=n_mask, other=0.0)
        a_s = b_s  # unused unless A_FP8
        if A_FP8:
            a_s = tl.load(as_ptrs + k0 // 128)
        acc = _scaled_dot(a, a_s, b, b_s, acc, A_FP8, ACT, DOT16)
        a_ptrs += BK
        b_ptrs += BK
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, _to_act(acc, ACT), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(o_ptr, w_ptr, y_ptr, D, stride_om, stride_ym,
                    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j)
        v = tl.load(o_ptr + (t * TOP_K + j) * stride_om + offs, mask=mask, other=0.0).to(tl.float32)
        acc += v * w
    tl.store(y_ptr + t * stride_ym + offs, _to_act(acc, ACT), mask=mask)


# ---------------------------------------------------------------------------------------------- entry point

@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n_gate_up: int = 128  # must be 128 in W8A8: one tile = one re-quantization group
    block_n_down: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    block_d_combine: int = 1024


# (max average pairs per expert, config): decode has ~1 pair per touched expert, so a 16-row tile wastes
# little; prefill fills 64-row tiles. 32- and 64-row tiles take 8 warps: the two gate/up accumulators spill
# with 4 (ptxas, sm_90). Stages: 3 keeps the 16-row gate/up kernel at 70 KB of shared memory (3 CTAs per SM).
MOE_CONFIGS: tuple[tuple[float, MoeConfig], ...] = (
    (4.0, MoeConfig(block_m=16, num_stages=3)),
    (24.0, MoeConfig(block_m=32, num_warps=8, num_stages=4)),
    (float("inf"), MoeConfig(block_m=64, num_warps=8, num_stages=3)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    avg = num_tokens * top_k / max(1, num_experts)
    for limit, cfg in MOE_CONFIGS:
        if avg <= limit:
            return cfg
    return MOE_CONFIGS[-1][1]


def _check_weights(gate_w, up_w, down_w, d: int) -> tuple[int, int]:
    num_experts, inter, dg = gate_w.shape
    if dg != d or up_w.shape != gate_w.shape or down_w.shape != (num_experts, d, inter):
        raise ValueError(f"shapes do not match: d={d}, gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, "
                         f"down {tuple(down_w.shape)}")
    for name, w in (("gate", gate_w), ("up", up_w), ("down", down_w)):
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} weight must be float8_e4m3fn, got {w.dtype}")
    return num_experts, inter


def _launch_opts(cfg: MoeConfig, w8a8: bool, dtype: torch.dtype) -> dict:
    return dict(BM=cfg.block_m, BK=cfg.block_k, A_FP8=w8a8, ACT=act_code(dtype), DOT16=dot16(dtype),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def moe_gate_up(x2, al: MoeAlignment, top_k: int, gate_w, gate_s, up_w, up_s, activation_quant: int,
                cfg: MoeConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 2: x2 [M, d] -> h [capacity, I] in padded-sorted row order: fp8 with scales [capacity, I/128] (W8A8)
    or x's dtype with None. Rows at or past al.num_padded are not written."""
    w8a8 = activation_quant == PER_TOKEN_GROUP
    m, d = x2.shape
    inter = gate_w.shape[1]
    cap = al.capacity
    if w8a8:
        a, a_s = quantize_activation(x2)  # once per token, not per pair
        h = torch.empty(cap, inter, dtype=torch.float8_e4m3fn, device=x2.device)
        hs = torch.empty(cap, inter // BLOCK, dtype=torch.float32, device=x2.device)
    else:
        a = x2 if x2.stride(1) == 1 else x2.contiguous()
        h = torch.empty(cap, inter, dtype=x2.dtype, device=x2.device)
        a_s = hs = gate_s  # placeholders, never read
    _gate_up_kernel[(cap // cfg.block_m * cdiv(inter, cfg.block_n_gate_up),)](
        a, a_s, gate_w, gate_s, up_w, up_s, h, hs, al.sorted_ids, al.tile_experts, al.num_padded,
        m * top_k, inter, d, top_k,
        a.stride(0), a_s.stride(0), gate_w.stride(0), gate_w.stride(1), gate_s.stride(0), gate_s.stride(1),
        h.stride(0), hs.stride(0),
        BN=cfg.block_n_gate_up, EVEN_K=d % cfg.block_k == 0, **_launch_opts(cfg, w8a8, x2.dtype))
    return h, (hs if w8a8 else None)


def moe_down(h, hs, al: MoeAlignment, num_pairs: int, down_w, down_s, dtype: torch.dtype,
             cfg: MoeConfig) -> torch.Tensor:
    """Stage 3: h (from moe_gate_up) -> one output row per pair [num_pairs, d] in `dtype` (x's dtype)."""
    w8a8 = hs is not None
    d, inter = down_w.shape[1:]
    pair_out = torch.empty(num_pairs, d, dtype=dtype, device=h.device)
    if not w8a8:
        hs = down_s  # placeholder, never read
    _down_kernel[(al.capacity // cfg.block_m * cdiv(d, cfg.block_n_down),)](
        h, hs, down_w, down_s, pair_out, al.sorted_ids, al.tile_experts, al.num_padded, num_pairs, d, inter,
        h.stride(0), hs.stride(0), down_w.stride(0), down_w.stride(1), down_s.stride(0), down_s.stride(1),
        pair_out.stride(0),
        BN=cfg.block_n_down, EVEN_K=inter % cfg.block_k == 0, **_launch_opts(cfg, w8a8, dtype))
    return pair_out


def moe_combine(pair_out, weights, out2, block_d: int = 1024) -> torch.Tensor:
    """Stage 4: out2[t] = Σ_k weights[t, k] · pair_out[t·k_top + k], fp32 sum, stored in out2's dtype."""
    m, top_k = weights.shape
    d = pair_out.shape[1]
    _combine_kernel[(m, cdiv(d, block_d))](
        pair_out, weights, out2, d, pair_out.stride(0), out2.stride(0),
        TOP_K=top_k, BLOCK_D=block_d, ACT=act_code(out2.dtype))
    return out2


def moe_fp8(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s,
            activation_quant: int = PER_TOKEN_GROUP, out: torch.Tensor | None = None,
            config: MoeConfig | None = None) -> torch.Tensor:
    """x [..., d] fp32/bf16/fp16; topk_ids int [..., k]; topk_weights fp32 [..., k]; gate/up fp8 [E, I, d],
    down fp8 [E, d, I] with fp32 128×128 block scales -> y [..., d] in x's dtype (into `out` when given)."""
    check_activation_quant(activation_quant)
    w8a8 = activation_quant == PER_TOKEN_GROUP
    d = x.shape[-1]
    num_experts, inter = _check_weights(gate_w, up_w, down_w, d)
    if w8a8 and (d % BLOCK or inter % BLOCK):
        raise ValueError(f"W8A8 MoE needs d and I multiples of {BLOCK}, got d={d}, I={inter}")
    act_code(x.dtype)
    x2 = x.reshape(-1, d)
    m = x2.shape[0]
    ids = topk_ids.reshape(m, -1)
    top_k = ids.shape[1]
    weights = topk_weights.reshape(m, top_k).to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    if m == 0:
        return out
    cfg = config or moe_config(m, top_k, num_experts)
    if w8a8 and cfg.block_n_gate_up != BLOCK:
        raise ValueError("W8A8 needs block_n_gate_up == 128 (one re-quantization group per tile)")
    if BLOCK % cfg.block_k:
        raise ValueError("block_k must divide 128 (one weight scale per K step)")
    gate_w, up_w, down_w = gate_w.contiguous(), up_w.contiguous(), down_w.contiguous()
    gate_s, up_s, down_s = (s.to(torch.float32).contiguous() for s in (gate_s, up_s, down_s))

    al = moe_align(ids, num_experts, cfg.block_m)
    h, hs = moe_gate_up(x2, al, top_k, gate_w, gate_s, up_w, up_s, activation_quant, cfg)
    pair_out = moe_down(h, hs, al, m * top_k, down_w, down_s, x.dtype, cfg)
    moe_combine(pair_out, weights, out.view(m, d), cfg.block_d_combine)
    return out
