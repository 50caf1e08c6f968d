"""Every plugin node kind's AOT launch, as one table: the static sizes its kernel specializes on (read from the
node's weight inputs and attributes), the tactics TensorRT times, and the launch for an activation dtype, FP8 mode,
tactic and those sizes.

The plugins' aot_impl (runtime/tensorrt/plugins.py), the compile test that compiles every configuration for sm_90
(tests/test_aot_compile.py) and `k2trt doctor`'s cases all take their launches from here, so a new kernel — INT4
experts, say — is a new row, checked by all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from k2trt.quantization import PACK_FACTOR
from k2trt.runtime.kernels.fp8_linear import LINEAR_TACTIC_ROWS
from k2trt.runtime.kernels.moe import GEMM_TACTICS
from k2trt.runtime.kernels.moe_int4 import INT4_TACTICS
from k2trt.runtime.aot import linear as aot_linear
from k2trt.runtime.aot import moe as aot_moe
from k2trt.runtime.aot import moe_int4 as aot_moe_int4

# where a static size comes from: (input name, axis) of a weight input (static in every graph), or an attribute
Size = Union[tuple[str, int], str]
DEFAULT_TACTIC = 0  # what TensorRT passes a plugin that declares no custom tactics


@dataclass(frozen=True)
class AotNode:
    op_type: str
    sizes: dict[str, Size]
    make: Callable  # make(act, activation_quant, tactic, **sizes) -> a launch (runtime/aot/ptx.compile_launch)
    tactics: tuple[int, ...] = ()  # custom tactics TensorRT times; () = one default

    def sizes_of(self, dim: Callable[[str, int], int], attr: Callable[[str], int]) -> dict[str, int]:
        """The node's static sizes, given dim(input, axis) (axis -1: the last) and attr(name)."""
        return {k: attr(v) if isinstance(v, str) else dim(*v) for k, v in self.sizes.items()}

    def launch(self, act: str | None, activation_quant: int, tactic: int, sizes: dict[str, int]):
        return self.make(act, activation_quant, tactic, **sizes)

    def every_tactic(self) -> tuple[int, ...]:
        return self.tactics or (DEFAULT_TACTIC,)


def _linear(act, aq, tactic, n, k):
    return aot_linear.linear_launch(act, n, k, aq, tactic)


def _gemm(stage):
    def make(act, aq, tactic, num_experts, out_cols, in_cols):
        return aot_moe.gemm_launch(stage, num_experts, out_cols, in_cols, act, aq, tactic)
    return make


def _int4_gemm(stage):
    """W4A16: no activation quantization (activation_quant does not apply); the packed words hold PACK_FACTOR
    input columns each."""
    def make(act, aq, tactic, num_experts, out_cols, words, group_size):
        return aot_moe_int4.int4_gemm_launch(stage, num_experts, out_cols, words * PACK_FACTOR, group_size, act,
                                             tactic)
    return make


AOT_NODES: dict[str, AotNode] = {n.op_type: n for n in (
    AotNode("Fp8BlockLinear", {"n": ("weight", 0), "k": ("weight", 1)}, _linear, tuple(LINEAR_TACTIC_ROWS)),
    AotNode("MoeAlign", {"num_experts": "num_experts"},
            lambda act, aq, tactic, num_experts: aot_moe.AlignLaunch(num_experts)),
    AotNode("MoeGateUp", {"num_experts": ("gate_weight", 0), "out_cols": ("gate_weight", 1),
                          "in_cols": ("gate_weight", 2)}, _gemm("gate_up"), tuple(GEMM_TACTICS)),
    AotNode("MoeDown", {"num_experts": ("down_weight", 0), "out_cols": ("down_weight", 1),
                        "in_cols": ("down_weight", 2)}, _gemm("down"), tuple(GEMM_TACTICS)),
    AotNode("MoeCombine", {"d": ("pair_out", 1), "top_k": ("topk_weights", -1)},
            lambda act, aq, tactic, d, top_k: aot_moe.CombineLaunch(d, top_k, act)),
    AotNode("MoeGateUpInt4", {"num_experts": ("gate_weight_packed", 0), "out_cols": ("gate_weight_packed", 1),
                              "words": ("gate_weight_packed", 2), "group_size": "group_size"},
            _int4_gemm("gate_up"), tuple(INT4_TACTICS)),
    AotNode("MoeDownInt4", {"num_experts": ("down_weight_packed", 0), "out_cols": ("down_weight_packed", 1),
                            "words": ("down_weight_packed", 2), "group_size": "group_size"},
            _int4_gemm("down"), tuple(INT4_TACTICS)),
)}
