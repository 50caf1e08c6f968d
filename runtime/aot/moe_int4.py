"""AOT launches of the INT4 MoE stage plugins (MoeGateUpInt4, MoeDownInt4): which kernel of
runtime/kernels/moe_int4.py, with which constants, tiles, grid and extra scalars. runtime/aot/ptx.py compiles a
launch to PTX; the plugin functions (runtime/tensorrt/plugins.py) hand it to TensorRT. MoeAlign and MoeCombine are the
FP8 MoE's own launches (runtime/aot/moe.py). The kernels' parameters are in TensorRT's launch order (inputs,
extra int32 scalars, outputs) and the tile rules are moe_int4.py's own, so AOT and JIT run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2trt.dtypes import torch_dtype
from k2trt.runtime.kernels import moe_int4
from k2trt.runtime.aot.ptx import config_key, shrink_tiles
from k2trt.runtime.aot.linear import act_pointer


@dataclass(frozen=True)
class Int4GemmLaunch:
    """The INT4 gate+up (stage "gate_up": out_cols = I, in_cols = d) or down GEMM ("down": d, I)."""
    stage: str
    num_experts: int
    out_cols: int
    in_cols: int
    group_size: int
    act: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def kernel(self):
        return moe_int4.gate_up_int4_kernel if self.stage == "gate_up" else moe_int4.down_int4_kernel

    @property
    def label(self) -> str:
        return f"moe_int4_{self.stage}_{self.num_experts}x{self.out_cols}x{self.in_cols}g{self.group_size}"

    @property
    def tiles(self) -> moe_int4.Int4Tiles:
        return moe_int4.Int4Tiles(self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages)

    def pointer_types(self) -> dict[str, str]:
        act = act_pointer(self.act, "INT4 MoE")
        ints = {"sorted_ptr": "i32", "off_ptr": "i32"}
        if self.stage == "gate_up":  # scales enter in the activation dtype (graphs/contracts.MOE_GATE_UP_INT4)
            return {"x_ptr": act, **ints, "gp_ptr": "i32", "gs_ptr": act, "up_ptr": "i32", "us_ptr": act,
                    "h_ptr": act}
        return {"h_ptr": act, **ints, "dp_ptr": "i32", "ds_ptr": act, "out_ptr": act}

    def constexprs(self) -> dict:
        return moe_int4.int4_constexprs(self.num_experts, self.out_cols, self.in_cols, self.group_size, self.tiles,
                                        torch_dtype(self.act))

    def shrink(self):
        return shrink_tiles(self)

    def config_key(self) -> tuple:
        """What the compiled code depends on besides the exact sizes (aot.config_key); E sets BLOCK_E, the group
        size the scales' stride."""
        return config_key(self, self.in_cols, self.block_k, (self.stage, self.act, self.num_experts, self.group_size))

    def grid(self, num_pairs, num_tokens, minimum=min):
        return (moe_int4.int4_grid(num_pairs, self.num_experts, self.out_cols, self.tiles, minimum), 1)

    def extra_args(self, num_pairs, num_tokens) -> tuple:
        return (num_tokens, num_pairs) if self.stage == "gate_up" else (num_pairs,)  # (M, n) / (n)


def int4_gemm_launch(stage: str, num_experts: int, out_cols: int, in_cols: int, group_size: int, act: str,
                     tactic: int) -> Int4GemmLaunch:
    t = moe_int4.int4_tiles(tactic, torch_dtype(act))
    return Int4GemmLaunch(stage, num_experts, out_cols, in_cols, group_size, act, t.block_m, t.block_n, t.block_k,
                          t.num_warps, t.num_stages)
