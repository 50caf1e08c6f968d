"""The custom nodes of the TensorRT-bound graphs, defined once.

The exporter emits these nodes, the torch reference registers them as torch.library custom ops, the ONNX Runtime
lowering replaces them, and the TensorRT plugins implement them; tests check that all four agree with this table.

A node maps to a `tensorrt.plugin` plugin when its op_type equals the plugin name and its string attribute
`plugin_namespace` equals the plugin namespace (TensorRT's ONNX parser rule). The node's domain is the same
namespace so that onnx.checker accepts it as a custom domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NAMESPACE = "k2trt"
PLUGIN_VERSION = "1"
DOMAIN_VERSION = 1

ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Port:
    name: str
    dtypes: tuple[str, ...]  # allowed element types; "act" ports share the activation dtype
    shape: str  # documentation, in terms of the dims below
    doc: str = ""


@dataclass(frozen=True)
class Attribute:
    name: str
    type: str  # "int" | "float" | "str"
    default: object
    doc: str


@dataclass(frozen=True)
class NodeContract:
    op_type: str
    doc: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attribute, ...] = field(default_factory=tuple)

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.op_type}"

    def attribute_names(self) -> list[str]:
        return [a.name for a in self.attributes]


ACTIVATION_QUANT = Attribute(
    "activation_quant", "int", 1,
    "0: weight dequant, GEMM in the activation dtype (W8A16); "
    "1: activations quantized per token per 128 channels to e4m3 (s = max(amax, 1e-4)/448), fp32 accumulation (W8A8)",
)

FP8_BLOCK_LINEAR = NodeContract(
    op_type="Fp8BlockLinear",
    doc="y = x · Wᵀ for an FP8 e4m3 weight with float32 128×128 block scales (partial edge blocks allowed).",
    inputs=(
        Port("x", ACTIVATION_DTYPES, "[B, T, K]", "activations; K a multiple of 128"),
        Port("weight", ("float8_e4m3fn",), "[N, K]"),
        Port("weight_scale_inv", ("float32",), "[ceil(N/128), ceil(K/128)]"),
    ),
    outputs=(Port("y", ACTIVATION_DTYPES, "[B, T, N]", "same dtype as x"),),
    attributes=(ACTIVATION_QUANT,),
)

MOE_FP8 = NodeContract(
    op_type="MoeFp8",
    doc=(
        "Routed experts of one MoE layer: dispatch the (token, expert) pairs, grouped FP8 GEMM gate and up, "
        "SiLU(gate)·up, grouped FP8 GEMM down, then y = Σ_k topk_weights[k] · expert_{topk_ids[k]}(x) "
        "accumulated in float32. The shared expert is not included."
    ),
    inputs=(
        Port("x", ACTIVATION_DTYPES, "[B, T, d]"),
        Port("topk_ids", ("int32",), "[B, T, k]", "chosen experts, 0 <= id < E"),
        Port("topk_weights", ("float32",), "[B, T, k]", "final weights (normalized, times routed_scaling_factor)"),
        Port("gate_weight", ("float8_e4m3fn",), "[E, I, d]"),
        Port("gate_scale_inv", ("float32",), "[E, ceil(I/128), ceil(d/128)]"),
        Port("up_weight", ("float8_e4m3fn",), "[E, I, d]"),
        Port("up_scale_inv", ("float32",), "[E, ceil(I/128), ceil(d/128)]"),
        Port("down_weight", ("float8_e4m3fn",), "[E, d, I]"),
        Port("down_scale_inv", ("float32",), "[E, ceil(d/128), ceil(I/128)]"),
    ),
    outputs=(Port("y", ACTIVATION_DTYPES, "[B, T, d]", "same dtype as x"),),
    attributes=(ACTIVATION_QUANT,),
)

CONTRACTS = {c.op_type: c for c in (FP8_BLOCK_LINEAR, MOE_FP8)}


def markdown_table() -> str:
    """The contracts as Markdown, for docs/ARCHITECTURE.md (a test keeps the doc in step)."""
    lines = []
    for c in CONTRACTS.values():
        lines.append(f"#### `{c.plugin_id}` (ONNX domain `{NAMESPACE}`, `plugin_namespace=\"{NAMESPACE}\"`)\n")
        lines.append(c.doc + "\n")
        lines.append("| port | name | dtype | shape | note |")
        lines.append("|---|---|---|---|---|")
        for kind, ports in (("in", c.inputs), ("out", c.outputs)):
            for p in ports:
                lines.append(f"| {kind} | `{p.name}` | {' / '.join(p.dtypes)} | {p.shape} | {p.doc} |")
        for a in c.attributes:
            lines.append(f"| attr | `{a.name}` | {a.type} (default {a.default}) | | {a.doc} |")
        lines.append("")
    return "\n".join(lines)
