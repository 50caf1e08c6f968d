"""The custom nodes of the graphs, defined once.

Three families:
  * the nodes graphs/blocks.py records (RECORDED): Fp8BlockLinear, MoeFp8 and MoeInt4 (the INT4 routed experts of
    K2-Thinking and K2.5), and MoeCombine where a MoE block is split at the dispatch for expert parallelism (its
    combine graph). The torch reference registers the first three as torch.library custom ops (MoeCombine is its
    reference, graphs/moe_ref.py), the ONNX Runtime lowering replaces them;
  * the nodes of the TensorRT-bound graphs (TENSORRT), each a TensorRT plugin that is exactly one kernel (so every
    one has an AOT implementation): Fp8BlockLinear, the four stages MoeFp8 is expanded into by
    export/split_moe.py (MOE_STAGES: align, gate+up, down, combine), and the four MoeInt4 is expanded into
    (MOE_INT4_STAGES: the same align and combine, INT4 gate+up and down), whose torch references are in
    graphs/moe_ref.py.
  * the paged attention nodes (PAGED): MlaPagedDecode and MlaPagedPrefill, the absorbed and the decompressed
    attention over a layer's latent pool read through the page tables, the step's rows beside it. graphs/blocks.py
    records them given a PagedCache (the torch reference runs every step so; export/block_graphs.py with
    paged=True); the ONNX Runtime lowering replaces them (tests/test_paged_node.py: both agree with the gathered
    form); for TensorRT export/split_attention.py expands each into two of the MLA_STAGES, a kernel of
    runtime/aot/mla.py each.
Tests check that the exporter, the references, the lowering, the split and the plugins agree with this table.

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
FP8 = "float8_e4m3fn"
# A port of this kind holds activations: fp8 e4m3 under W8A8 (with its scales in a port of their own), the
# activation dtype under W8A16.
QUANTIZED_ACTIVATION = (FP8, *ACTIVATION_DTYPES)
W8A8 = 1  # the activation_quant value that quantizes activations (graphs/fp8.PER_TOKEN_GROUP)


@dataclass(frozen=True)
class Port:
    name: str
    dtypes: tuple[str, ...]  # allowed element types; "act" ports share the activation dtype
    shape: str  # documentation, in terms of the dims below
    doc: str = ""

    def dtype_for(self, act: str | None, activation_quant: int) -> str:
        """The element type this port has in a graph computing in `act` with the given FP8 mode."""
        if self.dtypes in (ACTIVATION_DTYPES, QUANTIZED_ACTIVATION):
            if self.dtypes == QUANTIZED_ACTIVATION and activation_quant == W8A8:
                return FP8
            if act is None:
                raise ValueError(f"port {self.name} follows the activation dtype, and none is given")
            return act
        if len(self.dtypes) != 1:
            raise ValueError(f"port {self.name}: dtypes {self.dtypes} follow no rule")
        return self.dtypes[0]


@dataclass(frozen=True)
class Attribute:
    name: str
    type: str  # "int" | "float" | "str"
    default: object  # None: required
    doc: str


@dataclass(frozen=True)
class NodeContract:
    op_type: str
    doc: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attribute, ...] = field(default_factory=tuple)
    tensorrt: str = "plugin"  # how it reaches TensorRT: "plugin", or the module that expands it

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
    tensorrt="expanded into MoeAlign → MoeGateUp → MoeDown → MoeCombine by export/split_moe.py",
)

# ---- the stages of MoeFp8 in the TensorRT-bound graphs: one kernel each ------------------------------------
# n = B·T·k (token, expert) pairs; pair p is token p // k, slot p % k. The intermediates are graph tensors whose
# size is bounded by the shapes alone (no data-dependent shapes, no scratch memory).

_SORTED = Port("sorted_pairs", ("int32",), "[n]", "pair ids ordered by expert, in pair order within an expert")
_OFFSETS = Port("expert_offsets", ("int32",), "[E + 1]",
                "start of each expert's run in sorted_pairs; expert_offsets[E] = n")

MOE_ALIGN = NodeContract(
    op_type="MoeAlign",
    doc=("Stage 1 of MoeFp8: sort the (token, expert) pairs by expert (stable). Expert ids outside [0, E) are "
         "clamped into it: the router never produces them, and TensorRT times plugins on uninitialized inputs."),
    inputs=(Port("topk_ids", ("int32",), "[B, T, k]"),),
    outputs=(_SORTED, _OFFSETS),
    attributes=(Attribute("num_experts", "int", None, "E"),),
)

MOE_GATE_UP = NodeContract(
    op_type="MoeGateUp",
    doc=("Stage 2 of MoeFp8: for sorted row r (pair p = sorted_pairs[r], token p // k, expert e with "
         "expert_offsets[e] <= r < expert_offsets[e+1]) h[r] = SiLU(x·gate_eᵀ)·(x·up_eᵀ), each rounded to x's dtype "
         "as the reference does; under W8A8 x is quantized per token per 128 channels and h is re-quantized the "
         "same way."),
    inputs=(
        Port("x", ACTIVATION_DTYPES, "[B, T, d]"),
        _SORTED, _OFFSETS,
        Port("gate_weight", (FP8,), "[E, I, d]"),
        Port("gate_scale_inv", ("float32",), "[E, ceil(I/128), ceil(d/128)]"),
        Port("up_weight", (FP8,), "[E, I, d]"),
        Port("up_scale_inv", ("float32",), "[E, ceil(I/128), ceil(d/128)]"),
    ),
    outputs=(
        Port("h", QUANTIZED_ACTIVATION, "[n, I]", "float8_e4m3fn under W8A8, x's dtype under W8A16; sorted rows"),
        Port("h_scale", ("float32",), "[n, ceil(I/128)]", "per row and 128 channels (W8A8); 1 under W8A16"),
    ),
    attributes=(ACTIVATION_QUANT,),
)

MOE_DOWN = NodeContract(
    op_type="MoeDown",
    doc=("Stage 3 of MoeFp8: pair_out[sorted_pairs[r]] = (h[r]·h_scale[r])·down_eᵀ for the expert e of row r, "
         "accumulated in float32 and rounded to the activation dtype."),
    inputs=(
        Port("h", QUANTIZED_ACTIVATION, "[n, I]", "as MoeGateUp writes it"),
        Port("h_scale", ("float32",), "[n, ceil(I/128)]"),
        _SORTED, _OFFSETS,
        Port("down_weight", (FP8,), "[E, d, I]"),
        Port("down_scale_inv", ("float32",), "[E, ceil(d/128), ceil(I/128)]"),
    ),
    outputs=(Port("pair_out", ACTIVATION_DTYPES, "[n, d]", "in pair order; the dtype out_dtype names"),),
    attributes=(ACTIVATION_QUANT,
                Attribute("out_dtype", "int", None,
                          "the activation dtype as an ONNX element type (as Cast's `to`): 1 float32, 10 float16, "
                          "16 bfloat16 — under W8A8 no input carries it")),
)

MOE_COMBINE = NodeContract(
    op_type="MoeCombine",
    doc="Stage 4 of MoeFp8: y[t] = Σ_j topk_weights[t, j] · pair_out[t·k + j], summed in float32 (recorded on its "
        "own as the combine of a MoE block split for expert parallelism).",
    inputs=(
        Port("pair_out", ACTIVATION_DTYPES, "[n, d]"),
        Port("topk_weights", ("float32",), "[B, T, k]"),
    ),
    outputs=(Port("y", ACTIVATION_DTYPES, "[B, T, d]", "same dtype as pair_out"),),
)

MOE_STAGES = (MOE_ALIGN, MOE_GATE_UP, MOE_DOWN, MOE_COMBINE)

# ---- INT4 routed experts (compressed-tensors pack-quantized, W4A16: graphs/int4.py) ---------------------------
# Weights: int32 words of eight 4-bit values along the input dimension (value i at bits 4i..4i+3, offset by +8),
# one scale per group of g input channels; W = bf16(q · s). Activations stay in the activation dtype.

GROUP_SIZE = Attribute("group_size", "int", None, "g: input channels per scale (32 in K2-Thinking and K2.5)")
_INT4 = "int32"


def _int4_ports(name: str, rows: str, cols: str) -> tuple[Port, Port]:
    return (Port(f"{name}_weight_packed", (_INT4,), f"[E, {rows}, {cols}/8]", "8 int4 values per word, offset +8"),
            Port(f"{name}_weight_scale", ACTIVATION_DTYPES, f"[E, {rows}, {cols}/g]",
                 "bf16 in the checkpoint; the activation dtype in the graph (exact in float32)"))


MOE_INT4 = NodeContract(
    op_type="MoeInt4",
    doc=(
        "Routed experts of one MoE layer with INT4 group-quantized weights (W4A16): as MoeFp8, each weight "
        "dequantized group by group inside the GEMM to bf16(q·s), activations never quantized, fp32 accumulation; "
        "y = Σ_k topk_weights[k] · expert_{topk_ids[k]}(x) accumulated in float32. The shared expert is not included."
    ),
    inputs=(
        Port("x", ACTIVATION_DTYPES, "[B, T, d]"),
        Port("topk_ids", ("int32",), "[B, T, k]", "chosen experts, 0 <= id < E"),
        Port("topk_weights", ("float32",), "[B, T, k]", "final weights (normalized, times routed_scaling_factor)"),
        *_int4_ports("gate", "I", "d"), *_int4_ports("up", "I", "d"), *_int4_ports("down", "d", "I"),
    ),
    outputs=(Port("y", ACTIVATION_DTYPES, "[B, T, d]", "same dtype as x"),),
    attributes=(GROUP_SIZE,),
    tensorrt="expanded into MoeAlign → MoeGateUpInt4 → MoeDownInt4 → MoeCombine by export/split_moe.py",
)

MOE_GATE_UP_INT4 = NodeContract(
    op_type="MoeGateUpInt4",
    doc=("Stage 2 of MoeInt4: for sorted row r (pair p = sorted_pairs[r], token p // k, expert e of row r) "
         "h[r] = SiLU(x·gate_eᵀ)·(x·up_eᵀ) with W = bf16(q·s) unpacked group by group, each rounded to x's dtype as "
         "the reference does."),
    inputs=(Port("x", ACTIVATION_DTYPES, "[B, T, d]"), _SORTED, _OFFSETS,
            *_int4_ports("gate", "I", "d"), *_int4_ports("up", "I", "d")),
    outputs=(Port("h", ACTIVATION_DTYPES, "[n, I]", "x's dtype; sorted rows"),),
    attributes=(GROUP_SIZE,),
)

MOE_DOWN_INT4 = NodeContract(
    op_type="MoeDownInt4",
    doc=("Stage 3 of MoeInt4: pair_out[sorted_pairs[r]] = h[r]·down_eᵀ for the expert e of row r, W = bf16(q·s), "
         "accumulated in float32 and rounded to h's dtype."),
    inputs=(Port("h", ACTIVATION_DTYPES, "[n, I]", "as MoeGateUpInt4 writes it"), _SORTED, _OFFSETS,
            *_int4_ports("down", "d", "I")),
    outputs=(Port("pair_out", ACTIVATION_DTYPES, "[n, d]", "in pair order; h's dtype"),),
    attributes=(GROUP_SIZE,),
)

MOE_INT4_STAGES = (MOE_ALIGN, MOE_GATE_UP_INT4, MOE_DOWN_INT4, MOE_COMBINE)

# ---- paged MLA attention: the cache read where it lies ------------------------------------------------------
# The ports and attributes the two nodes and their TensorRT stages (MLA_STAGES, below) share.

_KV_POOL = Port("kv_pool", ACTIVATION_DTYPES, "[rows, L + R]",
                "the layer's pool: rows of normalized latent + k_pe, read in place")
_KV_SCALE = Port("kv_scale", ("float32",), "[1]", "the pool's scale (1 unless the pool is fp8)")
_PAGE_TABLE = Port("page_table", ("int32",), "[B, max_pages]", "each sequence's pages in position order")
_CTX_LENS = Port("ctx_lens", ("int32",), "[B]", "positions already in the pool")
_LATENT_NEW = Port("latent_new", ACTIVATION_DTYPES, "[B, T, L + R]", "this step's rows (the block's own)")
_N_NEW = Port("n_new", ("int32",), "[B]", "real rows of latent_new (≤ T)")
_SOFTMAX_SCALE = Attribute("softmax_scale", "float", None, "the model's: qk_head_dim^-0.5, times YaRN's mscale²")
_PAGE_TOKENS = Attribute("page_tokens", "int", None, "positions per page (runtime/cache/pages.PAGE_TOKENS)")
_LATENT = Attribute("latent_dim", "int", None, "L, kv_lora_rank (the rest of a row is the rope key)")
_HEADS = Attribute("heads", "int", None, "H")
_SHAPE_ATTRIBUTES = (_HEADS, Attribute("nope_dim", "int", None, "nope, qk_nope_head_dim"),
                     Attribute("rope_dim", "int", None, "R, qk_rope_head_dim"), Attribute("v_head_dim", "int", None, "v"))

MLA_PAGED_DECODE = NodeContract(
    op_type="MlaPagedDecode",
    doc=("MLA attention in latent space (absorbed) over a layer's paged latent pool: sequence b's context is its "
         "first ctx_lens[b] positions, position p in pool row page_table[b, p // page_tokens]·page_tokens + "
         "p % page_tokens; its step rows latent_new[b, :n_new[b]] follow at ctx_lens[b] + j. Query j < n_new[b] "
         "attends to the context and step rows 0..j: o_lat = Σ softmax(q_full · row · softmax_scale) · row[:L], "
         "scores and softmax in float32; queries j ≥ n_new[b] get 0. The pool is read where it lies, never copied; "
         "the runtime writes latent_new into it after the block."),
    inputs=(Port("q_full", ACTIVATION_DTYPES, "[B, T, H, L + R]", "q_nope · W_uk, then the rotated q_pe"),
            _KV_POOL, _PAGE_TABLE, _CTX_LENS, _LATENT_NEW, _N_NEW),
    outputs=(Port("o_lat", ACTIVATION_DTYPES, "[B, T, H, L]", "same dtype as q_full"),),
    attributes=(_SOFTMAX_SCALE, _PAGE_TOKENS, _LATENT),
    tensorrt="expanded into MlaDecodeSplit → MlaDecodeMerge by export/split_attention.py",
)
MLA_PAGED_PREFILL = NodeContract(
    op_type="MlaPagedPrefill",
    doc=("MLA attention decompressed (prefill) over a layer's paged latent pool, the context and step rows as "
         "MlaPagedDecode has them: every position's latent through kv_b into its key's nope part and its value per "
         "head (rounded to the activation dtype), beside the shared rope key; query j < n_new[b] attends to the "
         "context and step rows 0..j, scores and softmax in float32; queries j ≥ n_new[b] get 0."),
    inputs=(Port("q", ACTIVATION_DTYPES, "[B, T, H, nope + R]", "q_nope, then the rotated q_pe"),
            _KV_POOL, _PAGE_TABLE, _CTX_LENS, _LATENT_NEW, _N_NEW,
            Port("kv_b", ACTIVATION_DTYPES, "[H · (nope + v), L]",
                 "kv_b_proj: per head its W_uk rows, then its W_uv rows")),
    outputs=(Port("o", ACTIVATION_DTYPES, "[B, T, H, v]", "same dtype as q"),),
    attributes=(_SOFTMAX_SCALE, _PAGE_TOKENS, _LATENT, *_SHAPE_ATTRIBUTES),
    tensorrt="expanded into MlaDecompress → MlaAttend by export/split_attention.py",
)
PAGED = (MLA_PAGED_DECODE, MLA_PAGED_PREFILL)

# ---- the paged attention in the TensorRT-bound graphs: one kernel each (runtime/aot/mla.py) ------------------
# Each port list is its kernel's pointer parameters in order (TensorRT launches an AOT kernel with its inputs, the
# int32 scalars aot_impl returns, then its outputs). kv_scale: the pool's per-tensor scale, 1 for a pool in the
# activation dtype (the graphs' pools; an fp8 pool is the kernels' other form). S: the decode's context splits,
# a function of B, T and max_pages (runtime/tensorrt/plugins.decode_splits).

_POOL_PORTS = (_KV_POOL, _KV_SCALE, _PAGE_TABLE, _CTX_LENS)

MLA_DECODE_SPLIT = NodeContract(
    op_type="MlaDecodeSplit",
    doc=("Stage 1 of MlaPagedDecode (flash-decoding): sequence b's context positions are dealt in equal runs over S "
         "splits; split s attends its run (the last split also the step's rows) as MlaPagedDecode does and leaves "
         "its partial softmax: m, the running max of the scores in base 2 (score · softmax_scale · log2 e; -1e30 "
         "for an empty split), l = Σ 2^(score − m), acc = Σ 2^(score − m) · row[:L], all float32."),
    inputs=(Port("q_full", ACTIVATION_DTYPES, "[B, T, H, L + R]"), *_POOL_PORTS, _LATENT_NEW, _N_NEW),
    outputs=(Port("part_acc", ("float32",), "[B, T, H, S, L]"), Port("part_ml", ("float32",), "[B, T, H, S, 2]",
                                                                      "(m, l) per split")),
    attributes=(_SOFTMAX_SCALE, _PAGE_TOKENS, _LATENT, _HEADS),
)
MLA_DECODE_MERGE = NodeContract(
    op_type="MlaDecodeMerge",
    doc=("Stage 2 of MlaPagedDecode: o_lat = Σ_s acc_s · 2^(m_s − M) / Σ_s l_s · 2^(m_s − M), M = max_s m_s, in "
         "float32, rounded to the activation dtype; a row with nothing attended (every l_s = 0) gets 0."),
    inputs=(Port("part_acc", ("float32",), "[B, T, H, S, L]"), Port("part_ml", ("float32",), "[B, T, H, S, 2]")),
    outputs=(Port("o_lat", ACTIVATION_DTYPES, "[B, T, H, L]", "the dtype out_dtype names"),),
    attributes=(Attribute("out_dtype", "int", None, "the activation dtype as an ONNX element type (as Cast's `to`): "
                                                   "no input carries it"),),
)
MLA_DECOMPRESS = NodeContract(
    op_type="MlaDecompress",
    doc=("Stage 1 of MlaPagedPrefill: every position of sequence b (its ctx_lens[b] pool rows through the page "
         "table, then latent_new[b, :n_new[b]]) through kv_b: kv[b, p] = row_p[:L] · kv_bᵀ (· kv_scale for pool "
         "rows), accumulated in float32 and rounded to the activation dtype; rows past a sequence's positions are "
         "not written (MlaAttend never reads them)."),
    inputs=(*_POOL_PORTS, _N_NEW, _LATENT_NEW, Port("kv_b", ACTIVATION_DTYPES, "[H · (nope + v), L]")),
    outputs=(Port("kv", ACTIVATION_DTYPES, "[B, max_pages · page_tokens + T, H · (nope + v)]",
                  "per head its key's nope part, then its value"),),
    attributes=(_PAGE_TOKENS, _LATENT, *_SHAPE_ATTRIBUTES),
)
MLA_ATTEND = NodeContract(
    op_type="MlaAttend",
    doc=("Stage 2 of MlaPagedPrefill: causal attention per head over the decompressed rows, the rope key read from "
         "the pool (or latent_new) where it lies: query j < n_new[b] sees positions ≤ ctx_lens[b] + j; scores and "
         "softmax in float32; o in the activation dtype, 0 for queries j ≥ n_new[b]."),
    inputs=(Port("q", ACTIVATION_DTYPES, "[B, T, H, nope + R]"), *_POOL_PORTS, _N_NEW, _LATENT_NEW,
            Port("kv", ACTIVATION_DTYPES, "[B, P, H · (nope + v)]", "as MlaDecompress writes it")),
    outputs=(Port("o", ACTIVATION_DTYPES, "[B, T, H, v]"),),
    attributes=(_SOFTMAX_SCALE, _PAGE_TOKENS, _LATENT, *_SHAPE_ATTRIBUTES),
)
MLA_STAGES = (MLA_DECODE_SPLIT, MLA_DECODE_MERGE, MLA_DECOMPRESS, MLA_ATTEND)
# what graphs/blocks.py records; MoeCombine only in the combine of a MoE block split for expert parallelism
RECORDED = (FP8_BLOCK_LINEAR, MOE_FP8, MOE_INT4, MOE_COMBINE)
# the nodes of the TensorRT-bound graphs: one plugin each
TENSORRT = (FP8_BLOCK_LINEAR, *MOE_STAGES, MOE_GATE_UP_INT4, MOE_DOWN_INT4, *MLA_STAGES)
CONTRACTS = {c.op_type: c for c in (*RECORDED, *TENSORRT, *PAGED)}


def markdown_table() -> str:
    """The contracts as Markdown, for docs/ARCHITECTURE.md (a test keeps the doc in step)."""
    lines = []
    for c in CONTRACTS.values():
        lines.append(f"#### `{c.plugin_id}` (ONNX domain `{NAMESPACE}`, `plugin_namespace=\"{NAMESPACE}\"`)\n")
        lines.append(c.doc + "\n")
        lines.append(f"TensorRT: {'a plugin (JIT and AOT)' if c.tensorrt == 'plugin' else c.tensorrt}.\n")
        lines.append("| port | name | dtype | shape | note |")
        lines.append("|---|---|---|---|---|")
        for kind, ports in (("in", c.inputs), ("out", c.outputs)):
            for p in ports:
                lines.append(f"| {kind} | `{p.name}` | {' / '.join(p.dtypes)} | {p.shape} | {p.doc} |")
        for a in c.attributes:
            default = "required" if a.default is None else f"default {a.default}"
            lines.append(f"| attr | `{a.name}` | {a.type} ({default}) | | {a.doc} |")
        lines.append("")
    return "\n".join(lines)
