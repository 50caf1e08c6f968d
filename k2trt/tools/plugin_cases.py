"""One case per TensorRT plugin node: small inputs, its attributes and the torch reference's outputs, and the
one-node ONNX graph TensorRT builds for it (FP8 weights enter as network inputs consumed only by the plugin).

`k2trt doctor` builds and runs each case on the GPU; the tests run each through a stand-in of TensorRT's plugin
machinery on CPU, launching the AOT kernels under Triton's interpreter. The MoE stages chain: each stage's inputs
are the references' outputs of the stages before it, so a case checks one kernel alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import torch
from onnx import helper

from k2trt.dtypes import dtype as dtype_info
from k2trt.dtypes import name_of, one_ulp
from k2trt.export.block_graphs import IR_VERSION, OPSET
from k2trt.export.onnx_ops import plugin_attributes
from k2trt.graphs import contracts, int4, moe_ref
from k2trt.graphs.fp8 import PER_TOKEN_GROUP, dequant_activation, fp8_block_linear, quantize_weight

# B·T tokens; E experts of d -> I -> d, top-K; the linear maps d -> N (N = 200: a partial scale block)
B, T, D, INTER, E, K, N = 1, 3, 256, 128, 4, 2, 200
GROUP = 32  # INT4 experts' group size, as K2-Thinking's
TIGHT = 1e-5  # fp32 summation order, relative to max|reference|


@dataclass
class NodeCase:
    op_type: str
    act: str
    activation_quant: int
    inputs: dict[str, torch.Tensor]
    attrs: dict[str, int]
    expected: dict[str, torch.Tensor]
    dims: dict[str, list]  # every input's and output's dims for the ONNX graph (names are dynamic)

    @property
    def label(self) -> str:
        mode = "W4A16" if self.op_type.endswith("Int4") else (
            "W8A8" if self.activation_quant == PER_TOKEN_GROUP else "W8A16")
        return f"{self.op_type} ({self.act}, {mode})"


def node_cases(act: str = "bfloat16", activation_quant: int = PER_TOKEN_GROUP, seed: int = 0) -> list[NodeCase]:
    """A case for every contract in contracts.TENSORRT, in graph order (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    dt = dtype_info(act).torch
    aq = activation_quant
    x = torch.randn(B, T, D, generator=g).to(dt)
    w, s = quantize_weight(torch.randn(N, D, generator=g) * 0.05)
    gw, gs = quantize_weight(torch.randn(E, INTER, D, generator=g) * 0.1)
    uw, us = quantize_weight(torch.randn(E, INTER, D, generator=g) * 0.1)
    dw, ds = quantize_weight(torch.randn(E, D, INTER, generator=g) * 0.1)
    # skewed routing with an empty expert: expert 1 has three pairs, 0 one, 2 two, 3 none
    ids = torch.tensor([[[1, 0], [1, 2], [2, 1]]], dtype=torch.int32)
    topk_w = torch.rand(B, T, K, generator=g) + 0.1
    sorted_pairs, offsets = moe_ref.moe_align_reference(ids, E)
    h, h_scale = moe_ref.moe_gate_up_reference(x, sorted_pairs, offsets, gw, gs, uw, us, aq)
    pair_out = moe_ref.moe_down_reference(h, h_scale, sorted_pairs, offsets, dw, ds, aq, dt)
    y = moe_ref.moe_combine_reference(pair_out, topk_w)
    tok, n = ["B", "T"], ["n"]
    e1 = [E + 1]
    fp8_cases = [
        NodeCase("Fp8BlockLinear", act, aq, {"x": x, "weight": w, "weight_scale_inv": s},
                 {"activation_quant": aq}, {"y": fp8_block_linear(x, w, s, aq)},
                 {"x": tok + [D], "weight": list(w.shape), "weight_scale_inv": list(s.shape), "y": tok + [N]}),
        NodeCase("MoeAlign", act, aq, {"topk_ids": ids}, {"num_experts": E},
                 {"sorted_pairs": sorted_pairs, "expert_offsets": offsets},
                 {"topk_ids": tok + [K], "sorted_pairs": n, "expert_offsets": e1}),
        NodeCase("MoeGateUp", act, aq, {"x": x, "sorted_pairs": sorted_pairs, "expert_offsets": offsets,
                                        "gate_weight": gw, "gate_scale_inv": gs, "up_weight": uw,
                                        "up_scale_inv": us},
                 {"activation_quant": aq}, {"h": h, "h_scale": h_scale},
                 {"x": tok + [D], "sorted_pairs": n, "expert_offsets": e1, "gate_weight": list(gw.shape),
                  "gate_scale_inv": list(gs.shape), "up_weight": list(uw.shape), "up_scale_inv": list(us.shape),
                  "h": n + [INTER], "h_scale": n + [h_scale.shape[1]]}),
        NodeCase("MoeDown", act, aq, {"h": h, "h_scale": h_scale, "sorted_pairs": sorted_pairs,
                                      "expert_offsets": offsets, "down_weight": dw, "down_scale_inv": ds},
                 {"activation_quant": aq, "out_dtype": dtype_info(act).onnx}, {"pair_out": pair_out},
                 {"h": n + [INTER], "h_scale": n + [h_scale.shape[1]], "sorted_pairs": n, "expert_offsets": e1,
                  "down_weight": list(dw.shape), "down_scale_inv": list(ds.shape), "pair_out": n + [D]}),
        NodeCase("MoeCombine", act, aq, {"pair_out": pair_out, "topk_weights": topk_w}, {}, {"y": y},
                 {"pair_out": n + [D], "topk_weights": tok + [K], "y": tok + [D]}),
    ]
    return fp8_cases + _int4_cases(act, aq, g, x, sorted_pairs, offsets, tok, n, e1)


def _int4_experts(g: torch.Generator, rows: int, cols: int, dt: torch.dtype):
    """Packed INT4 weights [E, rows, cols/8] and their group scales as the graph takes them (activation dtype)."""
    q, s = int4.quantize_weight(torch.randn(E, rows, cols, generator=g) * 0.1, GROUP)
    return int4.pack(q), s.to(dt)


def _int4_cases(act, aq, g, x, sorted_pairs, offsets, tok, n, e1) -> list[NodeCase]:
    """The two INT4 GEMM stages (MoeAlign and MoeCombine are the FP8 MoE's, above)."""
    dt = dtype_info(act).torch
    gp, gs = _int4_experts(g, INTER, D, dt)
    up, us = _int4_experts(g, INTER, D, dt)
    dp, ds = _int4_experts(g, D, INTER, dt)
    h = moe_ref.moe_gate_up_int4_reference(x, sorted_pairs, offsets, gp, gs, up, us)
    pair_out = moe_ref.moe_down_int4_reference(h, sorted_pairs, offsets, dp, ds)
    shapes = {"gate_weight_packed": gp, "gate_weight_scale": gs, "up_weight_packed": up, "up_weight_scale": us}
    return [
        NodeCase("MoeGateUpInt4", act, aq, {"x": x, "sorted_pairs": sorted_pairs, "expert_offsets": offsets,
                                            **shapes}, {"group_size": GROUP}, {"h": h},
                 {"x": tok + [D], "sorted_pairs": n, "expert_offsets": e1,
                  **{k: list(v.shape) for k, v in shapes.items()}, "h": n + [INTER]}),
        NodeCase("MoeDownInt4", act, aq, {"h": h, "sorted_pairs": sorted_pairs, "expert_offsets": offsets,
                                          "down_weight_packed": dp, "down_weight_scale": ds}, {"group_size": GROUP},
                 {"pair_out": pair_out},
                 {"h": n + [INTER], "sorted_pairs": n, "expert_offsets": e1, "down_weight_packed": list(dp.shape),
                  "down_weight_scale": list(ds.shape), "pair_out": n + [D]}),
    ]


def one_node_model(case: NodeCase) -> onnx.ModelProto:
    """The case as a graph of one plugin node: its inputs are the network's inputs, its outputs the network's."""
    c = contracts.CONTRACTS[case.op_type]
    ins = [helper.make_tensor_value_info(p.name, dtype_info(name_of(case.inputs[p.name].dtype)).onnx,
                                         case.dims[p.name]) for p in c.inputs]
    outs = [helper.make_tensor_value_info(p.name, dtype_info(name_of(case.expected[p.name].dtype)).onnx,
                                          case.dims[p.name]) for p in c.outputs]
    node = helper.make_node(case.op_type, [p.name for p in c.inputs], [p.name for p in c.outputs],
                            name=case.op_type, domain=contracts.NAMESPACE, **plugin_attributes(), **case.attrs)
    graph = helper.make_graph([node], f"one_{case.op_type}", ins, outs)
    model = helper.make_model(graph, producer_name="k2trt doctor",
                              opset_imports=[helper.make_opsetid("", OPSET),
                                             helper.make_opsetid(contracts.NAMESPACE, contracts.DOMAIN_VERSION)])
    model.ir_version = IR_VERSION
    return model


def mismatches(case: NodeCase, outputs: dict[str, torch.Tensor]) -> list[str]:
    """How the outputs differ from the reference (empty: they match). Integers exactly; floats to one ulp of their
    dtype plus fp32 summation order; a W8A8 h through its dequantized value, to one fp8 step (a sum that differs in
    its last bit may round an element to the neighbouring e4m3 value)."""
    got = {k: v.to("cpu") for k, v in outputs.items()}
    problems = []
    for name, want in case.expected.items():
        g = got[name]
        if g.dtype != want.dtype or tuple(g.shape) != tuple(want.shape):
            problems.append(f"{name}: {g.dtype} {tuple(g.shape)}, expected {want.dtype} {tuple(want.shape)}")
        elif not want.dtype.is_floating_point:
            bad = int((g != want).sum())
            if bad:
                problems.append(f"{name}: {bad} of {want.numel()} elements differ")
        elif name == "h" and want.dtype == torch.float8_e4m3fn:
            problems.append(_close("h·h_scale", dequant_activation(g, got["h_scale"]),
                                   dequant_activation(want, case.expected["h_scale"]), one_ulp(name_of(want.dtype))))
        elif name == "h_scale":
            problems.append(_close(name, g.float(), want.float(), one_ulp(case.act)))
        else:
            problems.append(_close(name, g.float(), want.float(), one_ulp(name_of(want.dtype))))
    return [p for p in problems if p]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> str | None:
    if not bool(torch.isfinite(got).all()):
        return f"{name}: non-finite values"
    err = (got - want).abs()
    limit = rtol * want.abs() + TIGHT * want.abs().max()
    bad = int((err > limit).sum())
    return None if bad == 0 else f"{name}: {bad} of {want.numel()} elements off (max error {err.max().item():.3g})"
