"""One ONNX graph per block kind, recorded by running graphs/blocks.py with OnnxOps.

Dynamic dims, the same name in every graph: B (batch), T (new positions), P (cache slots; "P+T" for keys).
Weights are graph inputs named after the checkpoint suffixes (graphs/weights.py), so one graph serves every
layer of its kind. bf16 checkpoint tensors enter in the activation dtype; FP8 weights as float8_e4m3fn with
their float32 block scales (graphs/weights.graph_dtype).
"""

from __future__ import annotations

from k2trt.config import BLOCK_ACTIVATIONS, BLOCK_KINDS, MOE_PART_KINDS, K2Config
from k2trt.export.onnx_ops import OnnxOps
from k2trt.graphs import blocks
from k2trt.graphs import weights as W

OPSET = 20  # the newest opset onnx-tensorrt documents for TensorRT 10.0 (9-20); nothing here needs 21
IR_VERSION = 10  # onnxruntime rejects onnx 1.23's default IR 14


def weight_inputs(ops: OnnxOps, cfg: K2Config, kind: str, experts: int | None = None) -> dict:
    return {s.name: ops.input(s.name, W.graph_dtype(s.dtype, ops.act_dtype), list(s.shape))
            for s in W.graph_weight_specs(cfg, kind, experts)}


def activation_io(cfg: K2Config, kind: str, act: str) -> tuple[list, list]:
    """(inputs, outputs) of a kind as (name, dtype, shape) — everything but the weights. R: the (token, expert)
    pairs dispatched to one expert-parallel rank."""
    d, lat, half, k = cfg.hidden_size, cfg.latent_dim, cfg.qk_rope_head_dim // 2, cfg.num_experts_per_tok
    types = {
        "input_ids": ("int64", ["B", "T"]), "hidden_states": (act, ["B", "T", d]),
        "rope_cos": (act, ["B", "T", half]), "rope_sin": (act, ["B", "T", half]),
        "attention_mask": ("float32", ["B", "T", "P+T"]), "latent_cache": (act, ["B", "P", lat]),
        "hidden_states_out": (act, ["B", "T", d]), "latent_new": (act, ["B", "T", lat]),
        "logits": ("float32", ["B", "T", cfg.vocab_size]),
        # a MoE block's parts (expert parallelism)
        "residual": (act, ["B", "T", d]), "moe_input": (act, ["B", "T", d]), "shared_out": (act, ["B", "T", d]),
        "topk_ids": ("int32", ["B", "T", k]), "topk_weights": ("float32", ["B", "T", k]),
        "expert_rows": (act, ["R", d]), "expert_ids": ("int32", ["R"]), "expert_out": (act, ["R", d]),
        "pair_out": (act, [f"B*T*{k}", d]),
    }
    ins, outs = BLOCK_ACTIVATIONS[kind]
    return [(n, *types[n]) for n in ins], [(n, *types[n]) for n in outs]


PAGED_INPUTS = ("kv_pool", "page_table", "ctx_lens", "n_new")  # what an attention kind reads in place of the cache


def paged_io(cfg: K2Config, kind: str, act: str) -> tuple[list, list]:
    """activation_io of an attention kind read in place: the gathered cache and its mask replaced by the layer's
    pool, the page tables, the context lengths and the step's new counts (the MlaPagedDecode node's inputs)."""
    ins, outs = activation_io(cfg, kind, act)
    if "latent_cache" not in [n for n, _, _ in ins]:
        raise ValueError(f"{kind} has no attention to page")
    kept = [i for i in ins if i[0] not in ("attention_mask", "latent_cache")]
    types = {"kv_pool": (act, ["rows", cfg.latent_dim]), "page_table": ("int32", ["B", "pages"]),
             "ctx_lens": ("int32", ["B"]), "n_new": ("int32", ["B"])}
    return kept + [(n, *types[n]) for n in PAGED_INPUTS], outs


def build_block_graph(cfg: K2Config, kind: str, act_dtype: str = "float32", activation_quant: int = 1,
                      experts: int | None = None, branches: bool = False, paged: bool = False,
                      page_tokens: int = 64, large: bool = False):
    """The TensorRT-bound graph of one block kind (custom FP8 nodes for TensorRT's plugins), or of a MoE block's
    part (config.MOE_PART_KINDS; `experts`: the routed experts of one expert-parallel rank, for moe_experts).
    branches: the shape branches of graphs/blocks.py as If nodes (the graph ONNX Runtime's form is lowered from);
    without, one form only, as TensorRT takes no control flow: the small (attention absorbed: decode), or with
    `large` the large (attention decompressed: prefill).
    paged: the attention kinds read the layer's pool in place (paged_io; the MlaPagedDecode node, pages of
    `page_tokens` positions) instead of a gathered cache and its mask."""
    if kind not in BLOCK_KINDS + MOE_PART_KINDS:
        raise ValueError(f"unknown block kind {kind!r}; expected one of {BLOCK_KINDS + MOE_PART_KINDS}")
    ops = OnnxOps(act_dtype, OPSET, branches, large)
    ins, outs = (paged_io if paged else activation_io)(cfg, kind, act_dtype)
    a = {name: ops.input(name, dt, shape) for name, dt, shape in ins}
    if paged:
        a["attention_mask"] = None
        a["latent_cache"] = blocks.PagedCache(a["kv_pool"], a["page_table"], a["ctx_lens"], a["n_new"], page_tokens)
    w = weight_inputs(ops, cfg, kind, experts)
    if kind == "embedding":
        results = [blocks.embedding(ops, a["input_ids"], w)]
    elif kind == "head":
        results = [blocks.head(ops, cfg, a["hidden_states"], w)]
    elif kind == "moe_front":
        results = blocks.moe_front(ops, cfg, a["hidden_states"], a["rope_cos"], a["rope_sin"], a["attention_mask"],
                                   a["latent_cache"], w, activation_quant)
    elif kind == "moe_experts":
        results = [blocks.local_experts(ops, cfg, a["expert_rows"], a["expert_ids"], w, activation_quant)]
    elif kind == "moe_combine":
        results = [blocks.moe_combine(ops, a["pair_out"], a["topk_weights"], a["shared_out"], a["residual"])]
    else:
        results = blocks.decoder_block(ops, cfg, kind, a["hidden_states"], a["rope_cos"], a["rope_sin"],
                                       a["attention_mask"], a["latent_cache"], w, activation_quant)
    for sym, (name, _, shape) in zip(results, outs):
        ops.output(sym, name, shape)
    return ops.model(f"k2_{kind}", IR_VERSION)
