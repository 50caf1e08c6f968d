"""An EAGLE-3 draft as weightless graphs, recorded by running graphs/eagle.py with OnnxOps — the draft's one
definition of its math, as export/block_graphs.py records graphs/blocks.py:

  draft_fc     aux [B, T, 3 × target H]                                   -> hidden_states_out [B, T, H]
  draft_layer  input_ids [B, T], hidden_states [B, T, H], rope tables, the additive mask [B, T, P+T] and the
               draft's cache over P past positions (Llama layout: past_k, past_v [B, kv heads, P, head dim]; MLA
               layout: latent_cache [B, P, kv_lora + rope])             -> hidden_states_out, the new positions'
                                                                             cache (k_new, v_new | latent_new)
  draft_head   hidden_states [B, T, H]                                    -> logits [B, T, draft vocab] float32

The embedding is a weight input of the layer (`embed_tokens.weight`: the draft's own, or the target's where the
draft shares it), gathered in the graph as the target's embedding block does. Weights are graph inputs under the
draft's normalized names (k2trt/draft.py), bound once at load. An MLA-layout layer attends with the target's MLA
code over the gathered draft cache, so it branches on T as a target block does: an If for ONNX Runtime, and for
TensorRT (no control flow) two graphs, draft_layer (absorbed) and draft_layer.prefill (decompressed).
"""

from __future__ import annotations

from k2trt.config import K2Config
from k2trt.draft import Draft
from k2trt.draft_config import DraftConfig
from k2trt.export.block_graphs import IR_VERSION, OPSET
from k2trt.export.onnx_ops import OnnxOps
from k2trt.export.trt_form import PREFILL_SUFFIX
from k2trt.graphs import eagle

DRAFT_KINDS = ("draft_fc", "draft_layer", "draft_head")
EMBEDDING = "embed_tokens.weight"


def draft_forms(cfg: DraftConfig, kind: str) -> tuple[str, ...]:
    """TensorRT's forms of a draft kind: the MLA layer's two attention forms, else one."""
    return ("decode", "prefill") if kind == "draft_layer" and cfg.layout == "mla" else ("decode",)


def draft_trt_graphs(cfg: DraftConfig) -> list[tuple[str, str, str]]:
    """(kind, form, name) of each TensorRT graph of a draft: the name as its file and engine go by, the prefill
    form's suffixed as a block kind's is (export/trt_form.py)."""
    return [(kind, form, kind + (PREFILL_SUFFIX if form == "prefill" else ""))
            for kind in DRAFT_KINDS for form in draft_forms(cfg, kind)]


def draft_weight_names(draft: Draft, kind: str) -> list[str]:
    """The weight inputs of a kind, by the draft's normalized names (the embedding always: shared or its own)."""
    if kind == "draft_fc":
        return [n for n in draft.tensors if n.startswith(("fc.", "fc_norm."))]
    if kind == "draft_head":
        return ["norm.weight", "lm_head.weight"]
    if kind != "draft_layer":
        raise ValueError(f"unknown draft kind {kind!r}; expected one of {DRAFT_KINDS}")
    from k2trt.draft_config import LAYER

    return [EMBEDDING] + [n for n in draft.tensors if n.startswith(LAYER)]


def draft_io(cfg: DraftConfig, target: K2Config, kind: str, act: str) -> tuple[list, list]:
    """(inputs, outputs) of a draft kind as (name, dtype, shape), the weights apart."""
    h = cfg.hidden_size
    if kind == "draft_fc":
        return [("aux", act, ["B", "T", 3 * cfg.target_hidden_size])], [("hidden_states_out", act, ["B", "T", h])]
    if kind == "draft_head":
        return [("hidden_states", act, ["B", "T", h])], [("logits", "float32", ["B", "T", cfg.draft_vocab_size])]
    if cfg.layout == "mla":
        attn = cfg.attention_config(target)
        half, cache = attn.qk_rope_head_dim // 2, [("latent_cache", act, ["B", "P", attn.latent_dim])]
        new = [("latent_new", act, ["B", "T", attn.latent_dim])]
    else:
        half, kv = cfg.head_dim // 2, ["B", cfg.num_key_value_heads]
        cache = [("past_k", act, [*kv, "P", cfg.head_dim]), ("past_v", act, [*kv, "P", cfg.head_dim])]
        new = [("k_new", act, [*kv, "T", cfg.head_dim]), ("v_new", act, [*kv, "T", cfg.head_dim])]
    ins = [("input_ids", "int64", ["B", "T"]), ("hidden_states", act, ["B", "T", h]),
           ("rope_cos", act, ["B", "T", half]), ("rope_sin", act, ["B", "T", half]),
           ("attention_mask", "float32", ["B", "T", "P+T"]), *cache]
    return ins, [("hidden_states_out", act, ["B", "T", h]), *new]


def build_draft_graph(draft: Draft, target: K2Config, kind: str, act_dtype: str = "float32",
                      branches: bool = True, large: bool = False):
    """One draft kind's graph: with `branches`, the MLA layer's two attention forms as an If (ONNX Runtime);
    without, one form (TensorRT): the small (absorbed), or with `large` the decompressed."""
    cfg = draft.config
    ops = OnnxOps(act_dtype, OPSET, branches, large)
    ins, outs = draft_io(cfg, target, kind, act_dtype)
    a = {name: ops.input(name, dt, shape) for name, dt, shape in ins}
    shapes = {n: list(t.shape) for n, t in draft.tensors.items()}
    shapes.setdefault(EMBEDDING, [cfg.vocab_size, cfg.hidden_size])
    w = {n: ops.input(n, "act", shapes[n]) for n in draft_weight_names(draft, kind)}
    if kind == "draft_fc":
        results = [eagle.draft_fc(ops, cfg, a["aux"], w)]
    elif kind == "draft_head":
        results = [eagle.draft_head(ops, cfg, a["hidden_states"], w)]
    else:
        embeds = ops.cast(ops.gather_rows(w[EMBEDDING], a["input_ids"]), "act")
        if cfg.layout == "mla":
            results = eagle.draft_layer_mla(ops, cfg, cfg.attention_config(target), embeds, a["hidden_states"],
                                            a["rope_cos"], a["rope_sin"], a["attention_mask"], a["latent_cache"], w)
        else:
            results = eagle.draft_layer(ops, cfg, embeds, a["hidden_states"], a["rope_cos"], a["rope_sin"],
                                        a["attention_mask"], a["past_k"], a["past_v"], w)
    for sym, (name, _, shape) in zip(results, outs):
        ops.output(sym, name, shape)
    return ops.model(f"k2_{kind}", IR_VERSION)
