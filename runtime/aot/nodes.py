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

import numpy as np

from k2trt.graphs.contracts import ACTIVATION_DTYPES
from k2trt.quantization import PACK_FACTOR
from k2trt.runtime.kernels.fp8_linear import LINEAR_TACTIC_ROWS
from k2trt.runtime.kernels.moe import GEMM_TACTICS
from k2trt.runtime.kernels.moe_int4 import INT4_TACTICS
from k2trt.runtime.aot import linear as aot_linear
from k2trt.runtime.aot import mla as aot_mla
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
    # the activation dtypes it has an AOT form in; in the others its nodes run JIT (builder.set_aot_attribute)
    acts: tuple[str, ...] = ACTIVATION_DTYPES

    def sizes_of(self, dim: Callable[[str, int], int], attr: Callable[[str], int]) -> dict[str, int]:
        """The node's static sizes, given dim(input, axis) (axis -1: the last) and attr(name)."""
        return {k: attr(v) if isinstance(v, str) else dim(*v) for k, v in self.sizes.items()}

    def launch(self, act: str | None, activation_quant: int, tactic: int, sizes: dict[str, int]):
        if not self.has_aot(act):
            raise ValueError(f"{self.op_type} has no AOT form in {act} (only {', '.join(self.acts)})")
        return self.make(act, activation_quant, tactic, **sizes)

    def has_aot(self, act: str | None) -> bool:
        """None: a node with no activations (MoeAlign), the same in every dtype."""
        return act is None or act in self.acts

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


def _mla(launch_class, **fixed):
    """An MLA stage: the pool in the activation dtype (the graphs' pools), the rope width what the pool's row
    holds past the latent; the decode split in its split form (the merge follows it)."""
    def make(act, aq, tactic, width=None, **sizes):
        if width is not None:
            sizes["rope"] = width - sizes["latent"]
        if "softmax_scale" in sizes:  # as a plugin receives it: a FLOAT attribute is a float32 field
            sizes["softmax_scale"] = float(np.float32(sizes["softmax_scale"]))
        return launch_class(act=act, **({"pool": act} if launch_class is not aot_mla.MergeLaunch else {}),
                            **fixed, **sizes)
    return make


_MLA_SHAPE = {"heads": "heads", "latent": "latent_dim", "width": ("kv_pool", 1), "page_tokens": "page_tokens"}
_MLA_HEAD_DIMS = {"nope": "nope_dim", "v": "v_head_dim"}

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
    AotNode("MlaDecodeSplit", {**_MLA_SHAPE, "softmax_scale": "softmax_scale"},
            _mla(aot_mla.SplitLaunch, direct=False), acts=aot_mla.AOT_ACTIVATIONS),
    AotNode("MlaDecodeMerge", {"latent": ("part_acc", -1)}, _mla(aot_mla.MergeLaunch), acts=aot_mla.AOT_ACTIVATIONS),
    AotNode("MlaDecompress", {**_MLA_SHAPE, **_MLA_HEAD_DIMS}, _mla(aot_mla.DecompressLaunch),
            acts=aot_mla.AOT_ACTIVATIONS),
    AotNode("MlaAttend", {**_MLA_SHAPE, **_MLA_HEAD_DIMS, "softmax_scale": "softmax_scale"},
            _mla(aot_mla.AttendLaunch), acts=aot_mla.AOT_ACTIVATIONS),
)}
