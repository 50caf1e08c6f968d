"""One Triton kernel for the whole Fp8BlockLinear contract, so TensorRT can embed it as an AOT plugin.

An AOT plugin is exactly one compiled kernel per (types, tactic), launched by TensorRT with the arguments
(input pointers..., extra int32 scalars..., output pointers...). The runtime kernel in runtime/kernels/fp8_linear.py
quantizes activations in a separate launch (W8A8), so here the GEMM quantizes each [BM, 128] activation tile itself
with the same @triton.jit helpers — same bits as the two-launch path, at the price of re-quantizing a row tile once
per N tile (negligible next to the tile's dot). runtime/trt/aot.py compiles a plan to PTX.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from k2trt.dtypes import torch_dtype
from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, WEIGHT_DEQUANT, cdiv
from k2trt.runtime.kernels.fp8_linear import (_grouped_tile, _quant_group, _scaled_dot, _to_act, act_code, dot16,
                                              tactic_config)
from k2trt.runtime.trt.aot import shrink_tiles

# activation dtype name -> Triton pointer type (the kernels' ACT code comes from fp8_linear.act_code)
ACT_POINTERS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def act_pointer(act: str, plugin: str) -> str:
    if act not in ACT_POINTERS:
        raise ValueError(f"{plugin} AOT: activation dtype {act!r} is not one of {tuple(ACT_POINTERS)}")
    return ACT_POINTERS[act]



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
    pid_m, pid_n = _grouped_tile(pid, num_m, num_n, GROUP_M)

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
            q, a_s = _quant_group(a.to(tl.float32))  # one 1x128 group per row: BK == 128
            a = q.to(tl.float8e4nv)
        acc = _scaled_dot(a, a_s, b, b_s, acc, A_FP8, ACT, DOT16)
        x_ptrs += BK
        w_ptrs += BK
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, _to_act(acc, ACT), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class AotLinearPlan:
    """Everything TensorRT needs besides the PTX: constexprs, grid rule, launch width."""

    n: int
    k: int
    act: str
    activation_quant: int
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int

    kernel = fp8_linear_aot_kernel

    @property
    def block_k(self) -> int:
        return BLOCK

    @property
    def label(self) -> str:
        return f"linear_{self.n}x{self.k}"

    def pointer_types(self) -> dict[str, str]:
        ptr = ACT_POINTERS[self.act]
        return {"x_ptr": ptr, "w_ptr": "fp8e4nv", "ws_ptr": "fp32", "y_ptr": ptr}

    def constexprs(self) -> dict[str, int]:
        return {"N": self.n, "K": self.k, "BM": self.block_m, "BN": self.block_n, "BK": self.block_k,
                "GROUP_M": self.group_m, "A_FP8": int(self.activation_quant == PER_TOKEN_GROUP),
                "ACT": act_code(torch_dtype(self.act)), "DOT16": int(dot16(torch_dtype(self.act)))}

    def grid_x(self, m):
        """Works on ints and on TensorRT shape expressions (only + * // are used)."""
        return ((m + self.block_m - 1) // self.block_m) * cdiv(self.n, self.block_n)  # m may be an expression

    def shrink(self) -> "AotLinearPlan | None":
        return shrink_tiles(self)


def plan_for(act: str, n: int, k: int, activation_quant: int, tactic: int) -> AotLinearPlan:
    act_pointer(act, "Fp8BlockLinear")
    if activation_quant not in (WEIGHT_DEQUANT, PER_TOKEN_GROUP):
        raise ValueError(f"Fp8BlockLinear AOT: activation_quant must be 0 or 1, got {activation_quant}")
    if activation_quant == PER_TOKEN_GROUP and k % BLOCK:
        raise ValueError(f"Fp8BlockLinear W8A8 needs K a multiple of {BLOCK}, got {k}")
    cfg = tactic_config(tactic, n, k)
    return AotLinearPlan(n, k, act, activation_quant, cfg.block_m, cfg.block_n, cfg.group_m,
                         cfg.num_warps, cfg.num_stages)
