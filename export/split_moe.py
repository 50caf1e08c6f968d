"""The TensorRT-bound form of a recorded graph: every MoeFp8 node expanded into its four stages.

graphs/blocks.py records the routed experts once, as one MoeFp8 node (the torch reference and the ONNX Runtime
lowering use that node). A TensorRT plugin whose engine runs without Python is exactly one kernel (an AOT
plugin: TensorRT launches the PTX it returns with the plugin's own arguments, no workspace), so for TensorRT the
node becomes one plugin per kernel, the intermediates graph tensors whose size follows from the shapes:

  MoeFp8(x, ids, w, gate, up, down)  ->  MoeAlign(ids)                      -> sorted_pairs, expert_offsets
                                         MoeGateUp(x, sorted, offsets, ...) -> h, h_scale
                                         MoeDown(h, h_scale, sorted, ...)   -> pair_out
                                         MoeCombine(pair_out, w)            -> y
(graphs/contracts.MOE_STAGES; graphs/moe_ref.moe_fp8_reference is the same composition.) A MoeInt4 node becomes
MoeAlign, MoeGateUpInt4 -> h, MoeDownInt4 -> pair_out, MoeCombine (MOE_INT4_STAGES): W4A16 has no h_scale.
"""

from __future__ import annotations

import copy

import onnx
from onnx import helper

from k2trt.export.onnx_ops import dims, plugin_attributes, value_types
from k2trt.graphs import contracts


class _Split:
    def __init__(self, model: onnx.ModelProto):
        self.model = copy.deepcopy(model)
        self.types = value_types(self.model)
        self.nodes: list[onnx.NodeProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []

    def stage(self, contract: contracts.NodeContract, name: str, inputs: list[str], outputs: list, **attrs):
        """One stage node. A new output is (value name, element type, shape), annotated so shape inference
        continues past it; a plain name is a value annotated already (the MoeFp8 node's own output)."""
        names = [o if isinstance(o, str) else o[0] for o in outputs]
        self.nodes.append(helper.make_node(contract.op_type, inputs, names, name=name, domain=contracts.NAMESPACE,
                                           **plugin_attributes(), **attrs))
        self.value_info += [helper.make_tensor_value_info(*o) for o in outputs if not isinstance(o, str)]
        return names

    def expand(self, node: onnx.NodeProto) -> None:
        x, ids, wts, gw, gs, uw, us, dw, ds = node.input
        aq = next(a.i for a in node.attribute if a.name == "activation_quant")
        act = self.types[x].elem_type
        e, inter, d = dims(self.types[gw])
        k = dims(self.types[ids])[-1]
        gs_dims = dims(self.types[gs])
        if not all(isinstance(v, int) for v in (e, inter, d, k)):
            raise ValueError(f"{node.name}: MoeFp8 needs static expert shapes and top-k, "
                             f"got E={e} I={inter} d={d} k={k}")
        h_type = onnx.TensorProto.FLOAT8E4M3FN if aq == contracts.W8A8 else act
        n = f"B*T*{k}"  # pairs
        p = f"{node.name}/"
        sorted_pairs, offsets = self.stage(
            contracts.MOE_ALIGN, p + "align", [ids],
            [(p + "sorted_pairs", onnx.TensorProto.INT32, [n]), (p + "expert_offsets", onnx.TensorProto.INT32, [e + 1])],
            num_experts=e)
        h, h_scale = self.stage(
            contracts.MOE_GATE_UP, p + "gate_up", [x, sorted_pairs, offsets, gw, gs, uw, us],
            [(p + "h", h_type, [n, inter]), (p + "h_scale", onnx.TensorProto.FLOAT, [n, gs_dims[1]])],
            activation_quant=aq)
        (pair_out,) = self.stage(
            contracts.MOE_DOWN, p + "down", [h, h_scale, sorted_pairs, offsets, dw, ds],
            [(p + "pair_out", act, [n, d])], activation_quant=aq, out_dtype=act)
        self.stage(contracts.MOE_COMBINE, p + "combine", [pair_out, wts], list(node.output))

    def expand_int4(self, node: onnx.NodeProto) -> None:
        x, ids, wts, gp, gs, up, us, dp, ds = node.input
        group = next(a.i for a in node.attribute if a.name == "group_size")
        act = self.types[x].elem_type
        e, inter, _ = dims(self.types[gp])
        d = dims(self.types[dp])[1]
        k = dims(self.types[ids])[-1]
        if not all(isinstance(v, int) for v in (e, inter, d, k)):
            raise ValueError(f"{node.name}: MoeInt4 needs static expert shapes and top-k, "
                             f"got E={e} I={inter} d={d} k={k}")
        n = f"B*T*{k}"
        p = f"{node.name}/"
        sorted_pairs, offsets = self.stage(
            contracts.MOE_ALIGN, p + "align", [ids],
            [(p + "sorted_pairs", onnx.TensorProto.INT32, [n]), (p + "expert_offsets", onnx.TensorProto.INT32, [e + 1])],
            num_experts=e)
        (h,) = self.stage(contracts.MOE_GATE_UP_INT4, p + "gate_up", [x, sorted_pairs, offsets, gp, gs, up, us],
                          [(p + "h", act, [n, inter])], group_size=group)
        (pair_out,) = self.stage(contracts.MOE_DOWN_INT4, p + "down", [h, sorted_pairs, offsets, dp, ds],
                                 [(p + "pair_out", act, [n, d])], group_size=group)
        self.stage(contracts.MOE_COMBINE, p + "combine", [pair_out, wts], list(node.output))

    def run(self) -> onnx.ModelProto:
        for node in self.model.graph.node:
            if node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_FP8.op_type:
                self.expand(node)
            elif node.domain == contracts.NAMESPACE and node.op_type == contracts.MOE_INT4.op_type:
                self.expand_int4(node)
            else:
                self.nodes.append(node)
        g = self.model.graph
        del g.node[:]
        g.node.extend(self.nodes)
        g.value_info.extend(self.value_info)
        return self.model


def split_moe(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every MoeFp8 node replaced by MoeAlign, MoeGateUp, MoeDown and MoeCombine (and every
    MoeInt4 node by MoeAlign, MoeGateUpInt4, MoeDownInt4 and MoeCombine)."""
    return _Split(model).run()
