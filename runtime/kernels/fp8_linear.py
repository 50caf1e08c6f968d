"""Triton FP8 block-scaled linear: y = x · Wᵀ, the Fp8BlockLinear node contract (graphs/contracts.py).

W8A8 (activation_quant=1): a per-token-group kernel quantizes x in 1×128 groups (s = max(amax, 1e-4)/448), then a
GEMM accumulates `dot(a_fp8, b_fp8) · a_s[m, kb] · b_s[n//128, kb]` in fp32, one 128-wide K step at a time
(the fp8 dot never sums across scale groups, as in DeepSeek's kernel.py / DeepGEMM).
W8A16 (activation_quant=0): weight tiles are dequantized in-kernel, rounded to the activation dtype like the
reference, and multiplied in fp32 (fp32 activations, or any dtype under the interpreter) or bf16/fp16 on a GPU.

The @triton.jit helpers below are shared with the grouped MoE kernels in moe.py. Every cast to bf16 or fp8 is
preceded by an explicit round-to-nearest-even in fp32 (`_rne_*`), so the hardware cast only sees representable
values: the GPU gets the same bits as the CPU interpreter, whose own fp32→bf16/fp8 casts do not round to even.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, WEIGHT_DEQUANT, cdiv

# Every launch, JIT and AOT, asks for FMA contraction explicitly: Triton 3.9 defaults it on and warns that 3.10 turns
# it off (triton/knobs.py language_knobs.fp_fusion_enabled, FP_FUSION_DEFAULT_WARNING), and a kernel baked into an
# engine must not change with Triton's default. Off: the GPU rounds each multiply and add as graphs/fp8.py does.
FP_FUSION = False

# Activation dtype codes passed to kernels as constexpr (a dtype object is awkward to specialize on).
ACT_F32, ACT_BF16, ACT_F16 = 0, 1, 2
_ACT_CODE = {torch.float32: ACT_F32, torch.bfloat16: ACT_BF16, torch.float16: ACT_F16}


def interpreting() -> bool:
    """Whether the kernels run under Triton's CPU interpreter: @triton.jit decided that at import, from
    TRITON_INTERPRET, and only JITFunction objects compile for a GPU."""
    return not isinstance(act_quant_kernel, triton.runtime.jit.JITFunction)


def act_code(dtype: torch.dtype) -> int:
    if dtype not in _ACT_CODE:
        raise TypeError(f"activations must be float32, bfloat16 or float16, got {dtype}")
    return _ACT_CODE[dtype]


def checked_out(out: torch.Tensor | None, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A kernel's output buffer: a new one, or the caller's, which must be contiguous of this shape and dtype."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
    return out


def dot16(dtype: torch.dtype) -> bool:
    """W8A16 dots in the 16-bit activation dtype (tensor cores, exact products, fp32 accumulation). The interpreter's
    bf16 arithmetic is wrong, so there bf16 runs as fp32 (same result); its fp16 dot is right, so fp16 keeps the
    16-bit path and the CPU tests cover it."""
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting())


def check_activation_quant(activation_quant: int) -> None:
    if activation_quant not in (WEIGHT_DEQUANT, PER_TOKEN_GROUP):
        raise ValueError(
            f"activation_quant must be {WEIGHT_DEQUANT} or {PER_TOKEN_GROUP}, got {activation_quant}")


# ---------------------------------------------------------------------------------------------- jit helpers

@triton.jit
def rne_bf16(v):
    """fp32 -> nearest-even bf16 value, still fp32 (integer rounding on the magnitude bits; finite inputs)."""
    vb = v.to(tl.int32, bitcast=True)
    bits = vb & 0x7FFFFFFF
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return (bits | ((vb >> 31) << 31)).to(tl.float32, bitcast=True)  # sign bit back (keeps -0.0)


@triton.jit
def rne_e4m3(v):
    """fp32 -> nearest-even e4m3fn value (saturated to ±448), still fp32. Normal range: keep 3 mantissa bits;
    subnormals (|v| < 2^-6) sit on a 2^-9 grid, rounded with floor + tie test (no fp tricks a compiler may fold)."""
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    nrm = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    y = a * 512.0
    f = tl.floor(y)
    r = y - f
    up = (r > 0.5) | ((r == 0.5) & ((f.to(tl.int32) & 1) == 1))
    sub = (f + up.to(tl.float32)) * 0.001953125
    m = tl.where(a < 0.015625, sub, nrm).to(tl.int32, bitcast=True)
    return (m | ((v.to(tl.int32, bitcast=True) >> 31) << 31)).to(tl.float32, bitcast=True)  # keeps -0.0


@triton.jit
def round_act(v, ACT: tl.constexpr):
    """Round fp32 to the activation dtype and back (what the reference's `.to(x.dtype)` does)."""
    if ACT == 1:
        return rne_bf16(v)
    elif ACT == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def to_act(v, ACT: tl.constexpr):
    """fp32 -> a tensor of the activation dtype, rounded to nearest even."""
    if ACT == 1:
        return rne_bf16(v).to(tl.bfloat16)
    elif ACT == 2:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def quant_group(v):
    """[R, 128] fp32 -> (e4m3-valued fp32 [R, 128], scales [R]) exactly as graphs/fp8.quantize_activation."""
    amax = tl.max(tl.abs(v), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    q = rne_e4m3(tl.math.div_rn(v, s[:, None]))
    return q, s


@triton.jit
def scaled_dot(a, a_s, b, b_s, acc, A_FP8: tl.constexpr, ACT: tl.constexpr, DOT16: tl.constexpr):
    """One K step: acc += a[BM, BK] · b[BK, BN] with block scales; a_s [BM] (W8A8 only), b_s [BN]."""
    if A_FP8:
        # a fresh dot per 128-wide step, scaled, then added in fp32: the fp8 products never mix scale groups
        # (on sm_90 the wgmma of one step may sum its 128 products in reduced precision — DeepGEMM's trade too)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    else:
        w = to_act(b.to(tl.float32) * b_s[None, :], ACT)  # dequantized weight in the activation dtype
        if DOT16:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return acc


# ---------------------------------------------------------------------------------------------- kernels

@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm,
                      BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = (pid_m * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    rmask = rows < M
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=rmask[:, None], other=0.0)
    q, s = quant_group(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=rmask[:, None])
    tl.store(s_ptr + rows * stride_sm + g, s, mask=rmask)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), walking GROUP_M tile rows at a time so programs running together
    share weight tiles in L2."""
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def linear_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                   stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   A_FP8: tl.constexpr, ACT: tl.constexpr, DOT16: tl.constexpr, EVEN_K: tl.constexpr):
    # grouped launch order: GROUP_M row tiles share the weight tiles they are reading (L2 reuse in prefill)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)

    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bsn
    as_ptrs = as_ptr + offs_m * stride_asm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :] & k_ok[:, None], other=0.0)
        b_s = tl.load(bs_ptrs + k0 // 128, mask=n_mask, other=0.0)
        a_s = b_s  # unused unless A_FP8
        if A_FP8:
            a_s = tl.load(as_ptrs + k0 // 128, mask=m_mask, other=0.0)
        acc = scaled_dot(a, a_s, b, b_s, acc, A_FP8, ACT, DOT16)
        a_ptrs += BK
        b_ptrs += BK
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, to_act(acc, ACT), mask=m_mask[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------- wrappers

# ---- the whole contract in one kernel, for TensorRT's AOT plugin (runtime/aot/linear.py) --------------------
# An AOT plugin is exactly one compiled kernel, launched with (input pointers..., extra int32 scalars..., output
# pointers...). The two-launch path above quantizes activations separately (W8A8); here each [BM, 128] activation
# tile is quantized in registers with the same helpers — the same bits, at the price of re-quantizing a row tile
# once per N tile (negligible next to the tile's dot).

@triton.jit
def fp8_linear_aot_kernel(x_ptr, w_ptr, ws_ptr, M, y_ptr,
                          N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, GROUP_M: tl.constexpr, A_FP8: tl.constexpr, ACT: tl.constexpr,
                          DOT16: tl.constexpr):
    """y[M, N] = x[M, K] · W[N, K]ᵀ, all contiguous; W8A8 quantizes x tiles in registers."""
    KB: tl.constexpr = (K + 127) // 128  # row stride of the block scales
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n: tl.constexpr = (N + BN - 1) // BN
    pid_m, pid_n = grouped_tile(pid, num_m, num_n, GROUP_M)

    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    ws_ptrs = ws_ptr + (offs_n // 128) * KB
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if K % BK == 0:
            a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=n_mask[None, :] & k_ok[:, None], other=0.0)
        b_s = tl.load(ws_ptrs + k0 // 128, mask=n_mask, other=0.0)
        a_s = b_s  # unused unless A_FP8
        if A_FP8:
            q, a_s = quant_group(a.to(tl.float32))  # one 1x128 group per row: BK == 128
            a = q.to(tl.float8e4nv)
        acc = scaled_dot(a, a_s, b, b_s, acc, A_FP8, ACT, DOT16)
        x_ptrs += BK
        w_ptrs += BK
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, to_act(acc, ACT), mask=m_mask[:, None] & n_mask[None, :])


def quantize_activation(x: torch.Tensor, block_rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (K % 128 == 0, unit stride in K) -> (fp8 [M, K], fp32 scales [M, K/128]); same bits as
    graphs/fp8.quantize_activation."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"W8A8 needs the input dimension to be a multiple of {BLOCK}, got {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // BLOCK, dtype=torch.float32, device=x.device)
    if m:
        act_quant_kernel[(cdiv(m, block_rows), k // BLOCK)](
            x, q, s, m, x.stride(0), q.stride(0), s.stride(0), BLOCK_ROWS=block_rows, GROUP=BLOCK,
            enable_fp_fusion=FP_FUSION)
    return q, s


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# float32 W8A16 dots run on FMA units (input_precision="ieee") with fp32 operands in registers and shared memory, four
# times an fp8 tile: a K step of 16 and linear tiles of at most 64x64 keep every tactic within the 48 KiB of an AOT
# launch and 255 registers without a spill (the MoE GEMMs keep their 16/32/64 x 128 tiles at that K step);
# tests/test_aot_compile.py compiles every configuration for sm_90. K steps divide 128: one weight scale each.
FMA_BLOCK_K = 16
FMA_MAX_TILE = 64 * 64


def fma_dot(dtype: torch.dtype, activation_quant: int) -> bool:
    """Whether the GEMMs of this dtype and mode dot in fp32 on FMA units (no tensor-core path)."""
    return dtype == torch.float32 and activation_quant != PER_TOKEN_GROUP


def linear_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                  activation_quant: int = PER_TOKEN_GROUP) -> LinearConfig:
    """Per-shape tiles. Decode (few rows) is weight-bandwidth bound: narrow N tiles so that enough programs
    stream the weight (an H100/H200 has 132 SMs); prefill uses the usual 64×128 / 128×128 fp8 tiles. 64-row tiles
    take 8 warps: W8A8 quantizes the [64, 128] activation tile in registers, which spills with 4 (ptxas, sm_90)."""
    if m <= 16:
        bn = 128
        while bn > 16 and cdiv(n, bn) < 264:
            bn //= 2
        cfg = LinearConfig(16, bn, num_stages=4)
    elif m <= 64:
        cfg = LinearConfig(32, 64, num_stages=4) if m <= 32 else LinearConfig(64, 64, num_warps=8, num_stages=4)
    elif m <= 512:
        cfg = LinearConfig(64, 128, num_stages=3)
    else:
        cfg = LinearConfig(128, 128, num_warps=8, num_stages=3)
    if fma_dot(dtype, activation_quant):
        cfg = replace(cfg, block_k=FMA_BLOCK_K, block_n=min(cfg.block_n, FMA_MAX_TILE // cfg.block_m))
    return cfg


# TensorRT tactic id -> the row count whose tile config a tactic runs (the JIT and the AOT plugin alike); TensorRT
# times each per profile and keeps the fastest (decode: narrow N tiles, prefill: 128x128).
LINEAR_TACTIC_ROWS = {1: 1, 2: 64, 3: 4096}


def tactic_config(tactic: int, n: int, k: int, dtype: torch.dtype, activation_quant: int) -> LinearConfig:
    if tactic not in LINEAR_TACTIC_ROWS:
        raise ValueError(f"Fp8BlockLinear: unknown tactic {tactic}; expected one of {sorted(LINEAR_TACTIC_ROWS)}")
    return linear_config(LINEAR_TACTIC_ROWS[tactic], n, k, dtype, activation_quant)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     activation_quant: int = PER_TOKEN_GROUP, out: torch.Tensor | None = None,
                     config: LinearConfig | None = None) -> torch.Tensor:
    """y = x · Wᵀ; x [..., K] fp32/bf16/fp16, weight fp8 e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)].
    Returns y [..., N] in x's dtype (written into `out` when given)."""
    check_activation_quant(activation_quant)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input channels, weight expects {k}")
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if tuple(scale_inv.shape) != (cdiv(n, BLOCK), cdiv(k, BLOCK)):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)}")
    ac = act_code(x.dtype)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = checked_out(out, (*x.shape[:-1], n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    weight = weight.contiguous()
    scale_inv = scale_inv.to(torch.float32).contiguous()
    cfg = config or linear_config(m, n, k, x.dtype, activation_quant)
    if activation_quant == PER_TOKEN_GROUP:
        a, a_s = quantize_activation(x2)
    else:
        a = x2 if x2.stride(1) == 1 else x2.contiguous()
        a_s = scale_inv  # placeholder, never read
    y = out.view(m, n)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    linear_kernel[grid](
        a, a_s, weight, scale_inv, y, m, n, k,
        a.stride(0), a_s.stride(0), weight.stride(0), scale_inv.stride(0), y.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        A_FP8=activation_quant == PER_TOKEN_GROUP, ACT=ac, DOT16=dot16(x.dtype), EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION)
    return out
