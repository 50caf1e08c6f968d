"""One Triton kernel for the whole Fp8BlockLinear contract, so TensorRT can embed it as an AOT plugin.

An AOT plugin is exactly one compiled kernel per (types, tactic), launched by TensorRT with the arguments
(input pointers..., extra int32 scalars..., output pointers...). The kernel is runtime/kernels/fp8_linear.py's
fp8_linear_aot_kernel: the GEMM quantizes each [BM, 128] activation tile itself (W8A8) with the same @triton.jit
helpers as the two-launch path. runtime/aot/ptx.py compiles a launch to PTX.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.dtypes import torch_dtype
from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, WEIGHT_DEQUANT, cdiv
from k2trt.runtime.kernels.fp8_linear import act_code, dot16, fp8_linear_aot_kernel, tactic_config
from k2trt.runtime.aot.ptx import config_key, shrink_tiles

# activation dtype name -> Triton pointer type (the kernels' ACT code comes from fp8_linear.act_code)
ACT_POINTERS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def act_pointer(act: str, plugin: str) -> str:
    if act not in ACT_POINTERS:
        raise ValueError(f"{plugin} AOT: activation dtype {act!r} is not one of {tuple(ACT_POINTERS)}")
    return ACT_POINTERS[act]


@dataclass(frozen=True)
class LinearLaunch:
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
    block_k: int = BLOCK

    kernel = fp8_linear_aot_kernel

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

    def shrink(self) -> "LinearLaunch | None":
        return shrink_tiles(self)

    def config_key(self) -> tuple:
        """What the compiled code depends on besides the exact sizes (aot.config_key)."""
        return config_key(self, self.k, self.block_k, (self.act, self.activation_quant, self.group_m))


def linear_launch(act: str, n: int, k: int, activation_quant: int, tactic: int) -> LinearLaunch:
    act_pointer(act, "Fp8BlockLinear")
    if activation_quant not in (WEIGHT_DEQUANT, PER_TOKEN_GROUP):
        raise ValueError(f"Fp8BlockLinear AOT: activation_quant must be 0 or 1, got {activation_quant}")
    if activation_quant == PER_TOKEN_GROUP and k % BLOCK:
        raise ValueError(f"Fp8BlockLinear W8A8 needs K a multiple of {BLOCK}, got {k}")
    cfg = tactic_config(tactic, n, k, torch_dtype(act), activation_quant)
    return LinearLaunch(n, k, act, activation_quant, cfg.block_m, cfg.block_n, cfg.group_m,
                        cfg.num_warps, cfg.num_stages, cfg.block_k)
