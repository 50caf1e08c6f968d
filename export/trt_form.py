"""The TensorRT-bound graphs of a block kind: recorded (export/block_graphs.py), then every node that is more than
one kernel expanded into one plugin per kernel (export/split_moe.py, export/split_attention.py).

A kind with attention reads the layer's pool in place (paged) and has two forms, since TensorRT takes no control
flow: "decode", attention absorbed (T below blocks.decompress_from: decode and speculative verify steps), and
"prefill", attention decompressed (prefill chunks). Each form is a graph and an engine of its own; the runtime
picks one by the step's T, as the torch reference and the ONNX Runtime graphs branch on it.
"""

from __future__ import annotations

from k2trt.config import BLOCK_ACTIVATIONS, K2Config
from k2trt.export.block_graphs import build_block_graph
from k2trt.export.split_attention import split_attention
from k2trt.export.split_moe import split_moe

FORMS = ("decode", "prefill")
PREFILL_SUFFIX = ".prefill"  # the prefill form's name: trt/<kind>.prefill.onnx, <kind>.prefill.engine


def attends(kind: str) -> bool:
    """Whether a kind (or MoE part) holds attention, and so reads a layer's pool and has both forms."""
    return "latent_cache" in BLOCK_ACTIVATIONS[kind][0]


def forms(kind: str) -> tuple[str, ...]:
    return FORMS if attends(kind) else ("decode",)


def engine_name(kind: str, form: str = "decode") -> str:
    """The name a form's graph and engine go by: the kind for decode, "<kind>.prefill" for prefill."""
    if form not in forms(kind):
        raise ValueError(f"{kind} has no {form!r} form (its forms: {', '.join(forms(kind))})")
    return kind if form == "decode" else kind + PREFILL_SUFFIX


def engine_names(kinds) -> tuple[str, ...]:
    """Every form of each kind, by engine_name."""
    return tuple(engine_name(k, f) for k in kinds for f in forms(k))


def tensorrt_graph(cfg: K2Config, kind: str, act_dtype: str, activation_quant: int, experts: int | None = None,
                   expert_ranges: int = 1, form: str = "decode"):
    """The TensorRT-bound graph of one kind in one form (`experts`: a rank's routed experts, for moe_experts;
    `expert_ranges`: split_moe's fallback for plugin inputs over 2^31 elements)."""
    if form not in forms(kind):
        raise ValueError(f"{kind} has no {form!r} form (its forms: {', '.join(forms(kind))})")
    recorded = build_block_graph(cfg, kind, act_dtype, activation_quant, experts, paged=attends(kind),
                                 large=form == "prefill")
    return split_attention(split_moe(recorded, expert_ranges))
