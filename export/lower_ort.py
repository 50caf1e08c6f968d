"""Lower a TensorRT-bound graph to one ONNX Runtime runs on a CPU, plus the matching weight preparation.

  k2trt::Fp8BlockLinear(x, w, s)  ->  MatMul(x, W)         W = dequant(w, s)ᵀ, prepared once per layer
  k2trt::MoeFp8(x, ids, wts, ...) ->  com.microsoft::MoE   fc1 = [gate; up] rows interleaved, dequantized;
                                                           fc2 = down, dequantized
ONNX Runtime's MoE chooses its own top-k from router_probs, so the choice already made by the graph is
handed over exactly: router_probs = log(w) on the chosen experts and -1e9 elsewhere, with
normalize_routing_weights=1; the op then weighs expert e by w_e / Σw, and the output is multiplied by Σw.
(ORT's MoE runs fp32/fp16 on CPU and has no FP8 kernel there, hence the dequantized weights: this path
computes in the W8A16 convention.)

`prep` in the returned table tells the runtime how to make each new input from checkpoint tensors
(runtime/weights.py applies it).
"""

from __future__ import annotations

import copy

import onnx
from onnx import TensorProto, helper, numpy_helper

import numpy as np

from k2trt.export.onnx_ops import set_weight_prep, weight_prep
from k2trt.graphs import contracts

MS_DOMAIN = "com.microsoft"


def _shapes(model) -> dict[str, list]:
    model = onnx.shape_inference.infer_shapes(model)
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        dims = [d.dim_param if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = dims
    return out


def lower_for_ort(model: onnx.ModelProto, act_elem: int = TensorProto.FLOAT):
    """-> (lowered model, prep table {new input name: {"op": ..., "from": [graph input names]}})."""
    m = copy.deepcopy(model)
    g = m.graph
    shapes = _shapes(m)
    inputs = {i.name: i for i in g.input}
    prep: dict[str, dict] = weight_prep(model)  # preparations the graph already has (e.g. kv_b dequantized)
    new_nodes, new_inputs, consts = [], {}, []
    counter = [0]

    def fresh(h):
        counter[0] += 1
        return f"ort_{h}_{counter[0]}"

    def const(arr, hint):
        name = fresh(hint)
        consts.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def add_input(name, shape, op, sources):
        if name not in new_inputs:
            new_inputs[name] = helper.make_tensor_value_info(name, act_elem, shape)
            prep[name] = {"op": op, "from": sources}
        return name

    for node in g.node:
        if node.domain == contracts.NAMESPACE and node.op_type == contracts.FP8_BLOCK_LINEAR.op_type:
            x, w, s = node.input
            n, k = shapes[w]
            wt = add_input(f"{w}.dequant_t", [k, n], "dequant_t", [w, s])
            new_nodes.append(helper.make_node("MatMul", [x, wt], list(node.output), name=node.name))
        elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_FP8.op_type:
            x, ids, wts, gw, gs, uw, us, dw, ds = node.input
            e, inter, d = shapes[gw]
            k = shapes[ids][-1]
            fc1 = add_input("mlp.experts.gate_up_proj.weight.dequant_interleaved", [e, 2 * inter, d],
                            "moe_fc1_interleaved", [gw, gs, uw, us])
            fc2 = add_input("mlp.experts.down_proj.weight.dequant", [e, d, inter], "dequant", [dw, ds])
            # flatten tokens; build router_probs from the choice already made
            x2 = fresh("x2d")
            new_nodes.append(helper.make_node("Reshape", [x, const(np.array([-1, d], np.int64), "shape")], [x2]))
            ids2 = fresh("ids")
            ids64 = fresh("ids64")
            new_nodes.append(helper.make_node("Reshape", [ids, const(np.array([-1, k], np.int64), "shape")], [ids2]))
            new_nodes.append(helper.make_node("Cast", [ids2], [ids64], to=TensorProto.INT64))
            w2 = fresh("w2d")
            new_nodes.append(helper.make_node("Reshape", [wts, const(np.array([-1, k], np.int64), "shape")], [w2]))
            logw = fresh("logw")
            new_nodes.append(helper.make_node("Log", [w2], [logw]))
            n_tok = fresh("ntok")
            new_nodes.append(helper.make_node("Shape", [x2], [n_tok], start=0, end=1))
            probs_shape = fresh("pshape")
            new_nodes.append(helper.make_node("Concat", [n_tok, const(np.array([e], np.int64), "e")], [probs_shape],
                                              axis=0))
            floor = fresh("floor")
            new_nodes.append(helper.make_node("ConstantOfShape", [probs_shape], [floor],
                                              value=numpy_helper.from_array(np.array([-1e9], np.float32))))
            probs = fresh("router_probs")
            new_nodes.append(helper.make_node("ScatterElements", [floor, ids64, logw], [probs], axis=1))
            if act_elem != TensorProto.FLOAT:
                probs_c = fresh("router_probs_act")
                new_nodes.append(helper.make_node("Cast", [probs], [probs_c], to=act_elem))
                probs = probs_c
            y2 = fresh("moe")
            new_nodes.append(helper.make_node(
                "MoE", [x2, probs, fc1, "", fc2], [y2], domain=MS_DOMAIN, name=node.name,
                k=int(k), activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                normalize_routing_weights=1))
            wsum = fresh("wsum")
            new_nodes.append(helper.make_node("ReduceSum", [w2, const(np.array([-1], np.int64), "axes")], [wsum],
                                              keepdims=1))
            if act_elem != TensorProto.FLOAT:
                wsum_c = fresh("wsum_act")
                new_nodes.append(helper.make_node("Cast", [wsum], [wsum_c], to=act_elem))
                wsum = wsum_c
            y2s = fresh("moe_scaled")
            new_nodes.append(helper.make_node("Mul", [y2, wsum], [y2s]))
            new_nodes.append(helper.make_node("Reshape", [y2s, fresh_shape_of(x, new_nodes, fresh)],
                                              list(node.output)))
        else:
            new_nodes.append(node)

    used = {i for n in new_nodes for i in n.input}
    kept = [i for name, i in inputs.items() if name in used]
    del g.input[:]
    g.input.extend(kept + list(new_inputs.values()))
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(consts)
    # the custom nodes' annotations stay valid (same outputs); drop our domain, add com.microsoft
    opsets = [o for o in m.opset_import if o.domain != contracts.NAMESPACE]
    if any(n.domain == MS_DOMAIN for n in new_nodes):
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    del m.opset_import[:]
    m.opset_import.extend(opsets)
    set_weight_prep(m, prep)
    return m, prep


def fresh_shape_of(x: str, nodes: list, fresh) -> str:
    name = fresh("shape_of")
    nodes.append(helper.make_node("Shape", [x], [name]))
    return name
