"""AOT launches of the four MoE stage plugins (graphs/contracts.MOE_STAGES): which kernel of runtime/kernels/moe.py,
with which constants, tiles, grid and extra scalars. runtime/aot/ptx.py compiles a launch to PTX; the plugin
functions (runtime/tensorrt/plugins.py) hand the result to TensorRT. The kernels' parameters are already in TensorRT's
launch order, and the tile rules are moe.py's own, so the AOT plugins and the JIT path run the same code.

Every launch answers grid(num_pairs, num_tokens, minimum) and extra_args(num_pairs, num_tokens) on ints and on
TensorRT shape expressions alike (minimum: tensorrt.plugin.min for expressions).
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.dtypes import torch_dtype
from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, cdiv
from k2trt.runtime.kernels import moe
from k2trt.runtime.aot.ptx import config_key, shrink_tiles
from k2trt.runtime.aot.linear import act_pointer


def _ptr(act: str) -> str:
    return act_pointer(act, "MoE")


@dataclass(frozen=True)
class AlignLaunch:
    num_experts: int
    num_warps: int = moe.ALIGN_WARPS
    num_stages: int = 1

    kernel = moe.align_kernel
    label = "moe_align"

    def pointer_types(self) -> dict[str, str]:
        return {"ids_ptr": "i32", "sorted_ptr": "i32", "off_ptr": "i32"}

    def constexprs(self) -> dict:
        return moe.align_constexprs(self.num_experts)

    def shrink(self):
        return None

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, num_pairs, num_tokens, minimum=min):
        return (1, 1)

    def extra_args(self, num_pairs, num_tokens) -> tuple:
        return (num_pairs,)  # the kernel's n


@dataclass(frozen=True)
class GemmLaunch:
    """The gate+up (stage "gate_up": out_cols = I, in_cols = d) or the down GEMM ("down": d, I)."""
    stage: str
    num_experts: int
    out_cols: int
    in_cols: int
    act: str
    activation_quant: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = BLOCK

    @property
    def kernel(self):
        return moe.gate_up_kernel if self.stage == "gate_up" else moe.down_kernel

    @property
    def label(self) -> str:
        return f"moe_{self.stage}_{self.num_experts}x{self.out_cols}x{self.in_cols}"

    @property
    def tiles(self) -> moe.GemmTiles:
        return moe.GemmTiles(self.block_m, self.block_n, self.num_warps, self.num_stages, self.block_k)

    def pointer_types(self) -> dict[str, str]:
        act = _ptr(self.act)
        h = "fp8e4nv" if self.activation_quant == PER_TOKEN_GROUP else act
        ints = {"sorted_ptr": "i32", "off_ptr": "i32"}
        if self.stage == "gate_up":
            return {"x_ptr": act, **ints, "gw_ptr": "fp8e4nv", "gs_ptr": "fp32", "uw_ptr": "fp8e4nv",
                    "us_ptr": "fp32", "h_ptr": h, "hs_ptr": "fp32"}
        return {"h_ptr": h, "hs_ptr": "fp32", **ints, "w_ptr": "fp8e4nv", "s_ptr": "fp32", "out_ptr": act}

    def constexprs(self) -> dict:
        return moe.gemm_constexprs(self.num_experts, self.out_cols, self.in_cols, self.tiles,
                                   self.activation_quant, torch_dtype(self.act))

    def shrink(self):
        """As every GEMM launch shrinks, but N narrows for down only: gate+up tiles are one 128-wide group."""
        return shrink_tiles(self, narrow_n=self.stage == "down")

    def grid(self, num_pairs, num_tokens, minimum=min):
        return (moe.gemm_grid(num_pairs, self.num_experts, self.out_cols, self.tiles, minimum), 1)

    def config_key(self) -> tuple:
        """What the compiled code depends on besides the exact sizes (aot.config_key); E sets BLOCK_E."""
        return config_key(self, self.in_cols, self.block_k,
                          (self.stage, self.act, self.activation_quant, self.num_experts))

    def extra_args(self, num_pairs, num_tokens) -> tuple:
        return (num_tokens, num_pairs) if self.stage == "gate_up" else (num_pairs,)  # (M, n) / (n)


@dataclass(frozen=True)
class CombineLaunch:
    d: int
    top_k: int
    act: str
    num_warps: int = 4
    num_stages: int = 1

    kernel = moe.combine_kernel
    label = "moe_combine"

    def pointer_types(self) -> dict[str, str]:
        return {"o_ptr": _ptr(self.act), "w_ptr": "fp32", "y_ptr": _ptr(self.act)}

    def constexprs(self) -> dict:
        return moe.combine_constexprs(self.d, self.top_k, torch_dtype(self.act))

    def shrink(self):
        return None

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, num_pairs, num_tokens, minimum=min):
        return (num_tokens, cdiv(self.d, moe.COMBINE_BLOCK_D))

    def extra_args(self, num_pairs, num_tokens) -> tuple:
        return ()


def gemm_launch(stage: str, num_experts: int, out_cols: int, in_cols: int, act: str, activation_quant: int,
                tactic: int) -> GemmLaunch:
    _ptr(act)
    if activation_quant == PER_TOKEN_GROUP:
        # x (gate+up) and h (down) are quantized per 128 channels and h re-quantized per 128-wide tile: every
        # dimension of the W8A8 GEMMs is whole groups (the kernel masks its stores on N all the same)
        for what, size in (("d", out_cols if stage == "down" else in_cols),
                           ("I", in_cols if stage == "down" else out_cols)):
            if size % BLOCK:
                raise ValueError(f"MoE {stage} W8A8 needs {what} a multiple of {BLOCK}, got {size}")
    t = moe.gemm_tiles(stage, tactic, torch_dtype(act), activation_quant)
    return GemmLaunch(stage, num_experts, out_cols, in_cols, act, activation_quant, t.block_m, t.block_n,
                      t.num_warps, t.num_stages, t.block_k)
