"""Lower a TensorRT-bound graph to one ONNX Runtime runs on a CPU, plus the matching weight preparation.

  k2trt::Fp8BlockLinear(x, w, s)  ->  MatMul(x, W)         W = dequant(w, s)ᵀ, prepared once per layer
  k2trt::MoeFp8(x, ids, wts, ...) ->  com.microsoft::MoE   fc1 = [gate; up] rows interleaved, dequantized;
                                                           fc2 = down, dequantized
  k2trt::MoeInt4(x, ids, wts, ...) -> com.microsoft::MoE   the same, the INT4 weights unpacked to bf16(q·s)
  k2trt::MoeCombine(pair_out, wts) -> Cast, Mul, ReduceSum, Cast  (an expert-parallel block's combine)
  k2trt::MlaPagedDecode(q, pool, table, ctx, new, n) -> Gather through the table, then the absorbed attention
                                                          in float32 (ONNX Runtime has no paged kernel)
  k2trt::MlaPagedPrefill(..., kv_b)                   -> the same Gather, kv_b's MatMul, then attention per head
ONNX Runtime's MoE chooses its own top-k from router_probs, so the choice already made by the graph is
handed over exactly: router_probs = log(w) on the chosen experts and -1e9 elsewhere, with
normalize_routing_weights=1; the op then weighs expert e by w_e / Σw, and the output is multiplied by Σw.
(ORT's MoE runs fp32/fp16 on CPU and has no FP8 kernel there, hence the dequantized weights: this path
computes in the W8A16 convention. For INT4 the dequantized weights are exact: ORT's own int4 MoE, QMoE, computes
(q - 8)·s in float32 without the bf16 rounding the checkpoint's weights have, so it is not the same model; see
docs/PERFORMANCE.md for what it would save.)

The preparations come from the registry in graphs/weight_prep.py; the lowered graph records, for each new input,
which one and from which graph inputs, and the runtime applies it (runtime/backends/graph_weights.py).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from k2trt.export.onnx_ops import dims, elem, names_read, set_weight_prep, value_types, weight_prep
from k2trt.graphs import contracts
from k2trt.graphs.weight_prep import (DEQUANT, DEQUANT_T, INT4_DEQUANT, MOE_FC1_INTERLEAVED,
                                     MOE_FC1_INTERLEAVED_INT4, Preparation)

MS_DOMAIN = "com.microsoft"
NOT_CHOSEN = -1e9  # router_probs of the experts the graph did not choose: exp() of it is 0


def _shapes(model) -> dict[str, list]:
    return {name: dims(t) for name, t in value_types(model).items()}


class _Lowering:
    """The rewrite of one graph: new nodes in order, prepared weight inputs, and constants."""

    def __init__(self, model: onnx.ModelProto, act_dtype: str):
        self.model = copy.deepcopy(model)
        self.act_elem = elem(act_dtype)
        self.shapes = _shapes(self.model)
        self.prep: dict[str, dict] = weight_prep(model)  # the graph's own preparations (kv_b dequantized)
        self.nodes: list[onnx.NodeProto] = []
        self.new_inputs: dict[str, onnx.ValueInfoProto] = {}
        self.consts: list[onnx.TensorProto] = []
        self._count = 0

    # ---- plumbing ------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"ort_{hint}_{self._count}"

    def const(self, values, dtype=np.int64) -> str:
        name = self.fresh("const")
        self.consts.append(numpy_helper.from_array(np.asarray(values, dtype), name))
        return name

    def emit(self, op: str, inputs: list[str], hint: str | None = None, outputs: list[str] | None = None,
             **attrs) -> str:
        outs = outputs or [self.fresh(hint or op.lower())]
        self.nodes.append(helper.make_node(op, inputs, outs, **attrs))
        return outs[0]

    def to_act(self, name: str) -> str:
        """A float32 value in the activation dtype (a Cast only where they differ)."""
        return name if self.act_elem == TensorProto.FLOAT else self.emit("Cast", [name], "act", to=self.act_elem)

    def prepared(self, name: str, prep: Preparation, sources: list[str]) -> str:
        if name not in self.new_inputs:
            self.prep[name], shape = prep.record(sources, [self.shapes[s] for s in sources])
            self.new_inputs[name] = helper.make_tensor_value_info(name, self.act_elem, list(shape))
        return name

    # ---- the custom nodes ----------------------------------------------------------------------------
    def linear(self, node: onnx.NodeProto) -> None:
        x, w, s = node.input
        wt = self.prepared(f"{w}.{DEQUANT_T.name}", DEQUANT_T, [w, s])
        self.nodes.append(helper.make_node("MatMul", [x, wt], list(node.output), name=node.name))

    def moe(self, node: onnx.NodeProto, fc1_prep: Preparation, fc2_prep: Preparation) -> None:
        """MoeFp8 or MoeInt4 (the same inputs in the same order): ORT's MoE on the weights prepared dequantized."""
        x, ids, wts, gw, gs, uw, us, dw, ds = node.input
        e = self.shapes[gw][0]
        d = self.shapes[x][-1]
        k = self.shapes[ids][-1]
        fc1 = self.prepared(f"mlp.experts.gate_up_proj.weight.{fc2_prep.name}_interleaved", fc1_prep, [gw, gs, uw, us])
        fc2 = self.prepared(f"{dw}.{fc2_prep.name}", fc2_prep, [dw, ds])
        x2 = self.emit("Reshape", [x, self.const([-1, d])], "x2d")
        w2 = self.emit("Reshape", [wts, self.const([-1, k])], "w2d")
        probs = self.router_probs(x2, ids, w2, e, k)
        y2 = self.emit("MoE", [x2, probs, fc1, "", fc2], "moe", domain=MS_DOMAIN, name=node.name, k=int(k),
                       activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                       normalize_routing_weights=1)
        # the op weighs by w / Σw: multiply Σw back, then restore x's shape
        wsum = self.to_act(self.emit("ReduceSum", [w2, self.const([-1])], "wsum", keepdims=1))
        scaled = self.emit("Mul", [y2, wsum], "moe_scaled")
        self.emit("Reshape", [scaled, self.emit("Shape", [x], "shape_of")], outputs=list(node.output))

    def combine(self, node: onnx.NodeProto) -> None:
        """MoeCombine (the combine of an expert-parallel MoE block): y = Σ_j w[t, j] · pair_out[t·k + j] in
        float32, pair_out viewed as [B, T, k, d]."""
        pair_out, wts = node.input
        d = self.shapes[pair_out][-1]
        shape = self.emit("Concat", [self.emit("Shape", [wts], "wshape"), self.const([d])], "pshape", axis=0)
        pairs = self.emit("Cast", [self.emit("Reshape", [pair_out, shape], "pairs")], "pairs32", to=TensorProto.FLOAT)
        weighted = self.emit("Mul", [pairs, self.emit("Unsqueeze", [wts, self.const([-1])], "w4d")], "weighted")
        total = self.emit("ReduceSum", [weighted, self.const([2])], "combined", keepdims=0)
        self.emit("Cast", [total], outputs=list(node.output), to=self.act_elem)

    def _scalar_dim(self, x: str, axis: int, hint: str, times: int = 1) -> str:
        d = self.emit("Shape", [x], hint, start=axis, end=axis + 1)
        if times != 1:
            d = self.emit("Mul", [d, self.const([times])], hint)
        return self.emit("Squeeze", [d, self.const([0])], hint)

    def _unsq(self, x: str, axes: list[int], hint: str) -> str:
        return self.emit("Unsqueeze", [x, self.const(axes)], hint)

    def _paged_rows(self, pool: str, table: str, ctx: str, new: str, n_new: str, page: int) -> tuple[str, str, str]:
        """A paged node's keys as the contract lays them out: (rows [B, P + T, L + R] float32 — the context
        gathered through the page table, page ids clamped into the pool and every row past a context zeroed (the
        kernels never read them), then the step's rows — the visibility [B, T, P + T] (query j < n_new[b] sees the
        context and step rows 0..j, a padding query nothing) and which queries are real [B, T, 1])."""
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        zero, one = self.const(0), self.const(1)
        pos = self.emit("Range", [zero, self._scalar_dim(table, 1, "ctx_cap", page), one], "pos")  # [P]
        pages = self.emit("Gather", [self.emit("Cast", [table], "table64", to=i64),
                                     self.emit("Div", [pos, self.const(page)], "page_of")], "pages", axis=1)
        rows = self.emit("Add", [self.emit("Mul", [pages, self.const(page)], "page_row"),
                                 self.emit("Mod", [pos, self.const(page)], "in_page")], "rows")  # [B, P]
        last = self.emit("Sub", [self.emit("Shape", [pool], "pool_rows", start=0, end=1), self.const([1])], "last")
        rows = self.emit("Min", [self.emit("Max", [rows, self.const(0)], "rows_lo"), last], "rows_in")
        ctx_col = self._unsq(self.emit("Cast", [ctx], "ctx64", to=i64), [1], "ctx_col")
        held = self.emit("Less", [pos, ctx_col], "held")  # [B, P]
        past = self.emit("Cast", [self.emit("Gather", [pool, rows], "past", axis=0)], "past32", to=f32)
        past = self.emit("Where", [self._unsq(held, [2], "held3"), past, self.const(0.0, np.float32)], "past_held")
        kv = self.emit("Concat", [past, self.emit("Cast", [new], "new32", to=f32)], "kv", axis=1)
        j = self.emit("Range", [zero, self._scalar_dim(new, 1, "steps"), one], "j")  # [T]
        real = self.emit("Less", [j, self._unsq(self.emit("Cast", [n_new], "n64", to=i64), [1], "n_col")], "real")
        real3 = self._unsq(real, [2], "real3")  # [B, T, 1]
        causal = self.emit("LessOrEqual", [self._unsq(j, [0], "i_row"), self._unsq(j, [1], "j_col")], "causal")
        ok = self.emit("Concat", [self.emit("And", [self._unsq(held, [1], "held_row"), real3], "ok_past"),
                                  self.emit("And", [self._unsq(causal, [0], "causal3"), real3], "ok_new")],
                       "ok", axis=2)  # [B, T, P + T]
        return kv, ok, real3

    def _masked_softmax(self, scores: str, ok4: str, real4: str) -> str:
        """Softmax over the visible keys; a padding query's row (nothing visible) is 0."""
        masked = self.emit("Where", [ok4, scores, self.const(-np.inf, np.float32)], "masked")
        probs = self.emit("Softmax", [masked], "probs", axis=-1)
        return self.emit("Where", [real4, probs, self.const(0.0, np.float32)], "probs_real")

    def _attributes(self, node: onnx.NodeProto) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def paged_decode(self, node: onnx.NodeProto) -> None:
        """MlaPagedDecode as its contract states it: the absorbed attention in float32 over _paged_rows."""
        q, pool, table, ctx, new, n_new = node.input
        attrs = self._attributes(node)
        lat, scale = int(attrs["latent_dim"]), float(attrs["softmax_scale"])
        kv, ok, real3 = self._paged_rows(pool, table, ctx, new, n_new, int(attrs["page_tokens"]))
        keys = self._unsq(self.emit("Transpose", [kv], "kv_t", perm=[0, 2, 1]), [1], "keys")  # [B, 1, D, P+T]
        q32 = self.emit("Cast", [q], "q32", to=TensorProto.FLOAT)
        scores = self.emit("Mul", [self.emit("MatMul", [q32, keys], "qk"), self.const(scale, np.float32)],
                           "scores")  # [B, T, H, P+T]
        probs = self._masked_softmax(scores, self._unsq(ok, [2], "ok4"), self._unsq(real3, [3], "real4"))
        latent = self.emit("Slice", [kv, self.const([0]), self.const([lat]), self.const([2])], "latent")
        o = self.emit("MatMul", [probs, self._unsq(latent, [1], "latent4")], "o_lat")  # [B, T, H, L]
        self.emit("Cast", [o], outputs=list(node.output), to=self.act_elem)

    def paged_prefill(self, node: onnx.NodeProto) -> None:
        """MlaPagedPrefill as its contract states it: every row of _paged_rows through kv_b into keys and values
        (rounded to the activation dtype), then per head attention in float32."""
        q, pool, table, ctx, new, n_new, kv_b = node.input
        attrs = self._attributes(node)
        lat, scale, v = int(attrs["latent_dim"]), float(attrs["softmax_scale"]), int(attrs["v_head_dim"])
        f32 = TensorProto.FLOAT
        heads, nope, rope = int(attrs["heads"]), int(attrs["nope_dim"]), int(attrs["rope_dim"])
        qd = nope + rope
        kv, ok, real3 = self._paged_rows(pool, table, ctx, new, n_new, int(attrs["page_tokens"]))
        latent = self.emit("Slice", [kv, self.const([0]), self.const([lat]), self.const([2])], "latent")
        k_pe = self.emit("Slice", [kv, self.const([lat]), self.const([lat + rope]), self.const([2])], "k_pe")
        w_t = self.emit("Transpose", [self.emit("Cast", [kv_b], "kv_b32", to=f32)], "kv_b_t", perm=[1, 0])
        dec = self.emit("Cast", [self.emit("MatMul", [latent, w_t], "decompressed")], "dec_act", to=self.act_elem)
        dec = self.emit("Cast", [dec], "dec32", to=f32)  # keys and values in the activation dtype
        dec = self.emit("Transpose", [self.emit("Reshape", [dec, self.const([0, 0, heads, nope + v])], "dec4")],
                        "dec_h", perm=[0, 2, 1, 3])  # [B, H, S, nope + v]
        k_nope = self.emit("Slice", [dec, self.const([0]), self.const([nope]), self.const([3])], "k_nope")
        val = self.emit("Slice", [dec, self.const([nope]), self.const([nope + v]), self.const([3])], "values")
        qh = self.emit("Transpose", [self.emit("Cast", [q], "q32", to=f32)], "q_h", perm=[0, 2, 1, 3])  # [B,H,T,D]
        q_nope = self.emit("Slice", [qh, self.const([0]), self.const([nope]), self.const([3])], "q_nope")
        q_pe = self.emit("Slice", [qh, self.const([nope]), self.const([qd]), self.const([3])], "q_pe")
        s_nope = self.emit("MatMul", [q_nope, self.emit("Transpose", [k_nope], "k_nope_t", perm=[0, 1, 3, 2])], "sn")
        pe_t = self._unsq(self.emit("Transpose", [k_pe], "k_pe_t", perm=[0, 2, 1]), [1], "pe_t4")  # [B,1,R,S]
        s_pe = self.emit("MatMul", [q_pe, pe_t], "sp")
        scores = self.emit("Mul", [self.emit("Add", [s_nope, s_pe], "s"), self.const(scale, np.float32)], "scores")
        probs = self._masked_softmax(scores, self._unsq(ok, [1], "ok4"), self._unsq(real3, [1], "real4"))
        o = self.emit("Transpose", [self.emit("MatMul", [probs, val], "o_h")], "o", perm=[0, 2, 1, 3])  # [B,T,H,v]
        self.emit("Cast", [o], outputs=list(node.output), to=self.act_elem)

    def router_probs(self, x2: str, ids: str, w2: str, num_experts: int, k: int) -> str:
        """[tokens, E]: log(w) on the graph's chosen experts, NOT_CHOSEN elsewhere, in the activation dtype."""
        ids64 = self.emit("Cast", [self.emit("Reshape", [ids, self.const([-1, k])], "ids")], "ids64",
                          to=TensorProto.INT64)
        logw = self.emit("Log", [w2], "logw")
        n_tok = self.emit("Shape", [x2], "ntok", start=0, end=1)
        shape = self.emit("Concat", [n_tok, self.const([num_experts])], "pshape", axis=0)
        floor = self.emit("ConstantOfShape", [shape], "floor",
                          value=numpy_helper.from_array(np.array([NOT_CHOSEN], np.float32)))
        return self.to_act(self.emit("ScatterElements", [floor, ids64, logw], "router_probs", axis=1))

    # ---- the whole graph -----------------------------------------------------------------------------
    def run(self) -> onnx.ModelProto:
        self.nodes = self._lowered(self.model.graph.node)
        return self.finish()

    def _lowered(self, nodes) -> list[onnx.NodeProto]:
        """The nodes with every custom node replaced, inside an If's branches too (a branch reads the outer graph's
        values by name, so the constants and prepared weights it needs live in the outer graph)."""
        outer, self.nodes = self.nodes, []
        for node in nodes:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    branch = self._lowered(a.g.node)
                    del a.g.node[:]
                    a.g.node.extend(branch)
            if node.domain == contracts.NAMESPACE and node.op_type == contracts.FP8_BLOCK_LINEAR.op_type:
                self.linear(node)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_FP8.op_type:
                self.moe(node, MOE_FC1_INTERLEAVED, DEQUANT)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_INT4.op_type:
                self.moe(node, MOE_FC1_INTERLEAVED_INT4, INT4_DEQUANT)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_COMBINE.op_type:
                self.combine(node)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MLA_PAGED_DECODE.op_type:
                self.paged_decode(node)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MLA_PAGED_PREFILL.op_type:
                self.paged_prefill(node)
            else:
                self.nodes.append(node)
        lowered, self.nodes = self.nodes, outer
        return lowered

    def finish(self) -> onnx.ModelProto:
        m, g = self.model, self.model.graph
        used = names_read(self.nodes)
        kept = [i for i in g.input if i.name in used]
        del g.input[:]
        g.input.extend(kept + list(self.new_inputs.values()))
        del g.node[:]
        g.node.extend(self.nodes)
        g.initializer.extend(self.consts)
        # the custom nodes' annotations stay valid (same outputs); drop our domain, add com.microsoft
        opsets = [o for o in m.opset_import if o.domain != contracts.NAMESPACE]
        if any(n.domain == MS_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        del m.opset_import[:]
        m.opset_import.extend(opsets)
        set_weight_prep(m, self.prep)
        return m


def lower_for_ort(model: onnx.ModelProto, act_dtype: str = "float32") -> onnx.ModelProto:
    """The lowered model; its prep table ({new input name: {"op": ..., "from": [graph input names]}}) is in its
    metadata (onnx_ops.weight_prep)."""
    return _Lowering(model, act_dtype).run()
