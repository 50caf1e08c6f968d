"""One case per TensorRT plugin node: small inputs, its attributes and the torch reference's outputs, and the
one-node ONNX graph TensorRT builds for it (FP8 weights enter as network inputs consumed only by the plugin).

`k2trt doctor` builds and runs each case on the GPU; the tests run each through a stand-in of TensorRT's plugin
machinery on CPU, launching the AOT kernels under Triton's interpreter. The MoE stages chain: each stage's inputs
are the references' outputs of the stages before it, so a case checks one kernel alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import torch
from onnx import helper

from k2trt.dtypes import dtype as dtype_info
from k2trt.dtypes import name_of, one_ulp
from k2trt.export.block_graphs import IR_VERSION, OPSET
from k2trt.export.onnx_ops import plugin_attributes
from k2trt.graphs import contracts, int4, mla_ref, moe_ref
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
    expected: dict[str, torch.Tensor]  # NaN where the contract leaves an output unwritten
    dims: dict[str, list]  # every input's and output's dims for the ONNX graph (names are dynamic)
    # output -> (relative, fraction of max|reference|) where a kernel rounds more than its output's dtype does
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)

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
    return fp8_cases + _int4_cases(act, aq, g, x, sorted_pairs, offsets, tok, n, e1) + _mla_cases(act, aq, g)


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


# The paged attention's stages: three sequences over a pool of 8 pages with holes and a shared page, a context
# ending mid-page, an empty one and one over three pages; 3, 2 and 1 real rows of the step's 3.
# Pages of 32 positions: at least the split kernel's step (graphs/mla_ref.split_partials_reference deals pages).
MLA_HEADS, MLA_LATENT, MLA_ROPE, MLA_NOPE, MLA_V, MLA_PAGE = 2, 64, 16, 32, 32, 32
MLA_TABLES = [[5, 2, 7], [0, 0, 0], [2, 6, 1]]
MLA_CONTEXT, MLA_NEW, MLA_T = [17, 0, 70], [3, 2, 1], 3


def _mla_cases(act: str, aq: int, g: torch.Generator) -> list[NodeCase]:
    """MlaDecodeSplit, MlaDecodeMerge (on the split's reference partials), MlaDecompress and MlaAttend (on the
    decompression's reference rows). The split's and the attention's kernels round the probabilities to the
    activation dtype for their second dot (mla_decode's numerics): two of its ulps of the largest value."""
    from k2trt.runtime.tensorrt.plugins import decode_splits

    dt = dtype_info(act).torch
    b, t, h, width = len(MLA_TABLES), MLA_T, MLA_HEADS, MLA_LATENT + MLA_ROPE
    scale = (MLA_NOPE + MLA_ROPE) ** -0.5
    pool = torch.randn(8 * MLA_PAGE, width, generator=g).to(dt)
    tables = torch.tensor(MLA_TABLES, dtype=torch.int32)
    lens, n_new = torch.tensor(MLA_CONTEXT, dtype=torch.int32), torch.tensor(MLA_NEW, dtype=torch.int32)
    new = torch.randn(b, t, width, generator=g).to(dt)
    q_full = torch.randn(b, t, h, width, generator=g).to(dt)
    q = torch.randn(b, t, h, MLA_NOPE + MLA_ROPE, generator=g).to(dt)
    kv_b = (torch.randn(h * (MLA_NOPE + MLA_V), MLA_LATENT, generator=g) * MLA_LATENT ** -0.5).to(dt)
    one = torch.ones(1)
    splits = decode_splits(b, t, h, len(MLA_TABLES[0]), MLA_PAGE)
    part_acc, part_ml = mla_ref.split_partials_reference(q_full, pool, tables, lens, new, n_new, scale, MLA_PAGE,
                                                         splits, MLA_LATENT)
    positions = len(MLA_TABLES[0]) * MLA_PAGE + t
    kv = mla_ref.decompress_reference(pool, tables, lens, n_new, new, kv_b, MLA_PAGE, positions, MLA_LATENT)
    o = mla_ref.paged_mla_prefill_reference(q, pool, tables, lens, n_new, kv_b, scale, MLA_PAGE, MLA_V,
                                            latent_dim=MLA_LATENT, new=new)
    paged = {"kv_pool": pool, "kv_scale": one, "page_table": tables, "ctx_lens": lens}
    paged_dims = {"kv_pool": ["rows", width], "kv_scale": [1], "page_table": ["B", "pages"], "ctx_lens": ["B"],
                  "n_new": ["B"], "latent_new": ["B", "T", width]}
    parts = ["B", "T", h, "S"]
    sizes = {"page_tokens": MLA_PAGE, "latent_dim": MLA_LATENT}
    heads = {"heads": h, "nope_dim": MLA_NOPE, "rope_dim": MLA_ROPE, "v_head_dim": MLA_V}
    rounded = (one_ulp(act), 2 * one_ulp(act) + TIGHT)
    return [
        NodeCase("MlaDecodeSplit", act, aq, {"q_full": q_full, **paged, "latent_new": new, "n_new": n_new},
                 {"softmax_scale": scale, **sizes, "heads": h}, {"part_acc": part_acc, "part_ml": part_ml},
                 {"q_full": ["B", "T", h, width], **paged_dims, "part_acc": parts + [MLA_LATENT],
                  "part_ml": parts + [2]}, {"part_acc": rounded}),
        NodeCase("MlaDecodeMerge", act, aq, {"part_acc": part_acc, "part_ml": part_ml},
                 {"out_dtype": dtype_info(act).onnx},
                 {"o_lat": mla_ref.merge_partials_reference(part_acc, part_ml, dt)},
                 {"part_acc": parts + [MLA_LATENT], "part_ml": parts + [2], "o_lat": ["B", "T", h, MLA_LATENT]}),
        NodeCase("MlaDecompress", act, aq, {**paged, "n_new": n_new, "latent_new": new, "kv_b": kv_b},
                 {**sizes, **heads}, {"kv": kv},
                 {**paged_dims, "kv_b": list(kv_b.shape), "kv": ["B", "P", kv_b.shape[0]]}),
        NodeCase("MlaAttend", act, aq, {"q": q, **paged, "n_new": n_new, "latent_new": new,
                                        "kv": kv.nan_to_num(0.0)},
                 {"softmax_scale": scale, **sizes, **heads}, {"o": o},
                 {"q": ["B", "T", h, MLA_NOPE + MLA_ROPE], **paged_dims, "kv": ["B", "P", kv_b.shape[0]],
                  "o": ["B", "T", h, MLA_V]}, {"o": rounded}),
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
            problems.append(_close(name, g.float(), want.float(),
                                   *case.tolerance.get(name, (one_ulp(name_of(want.dtype)), TIGHT))))
    return [p for p in problems if p]


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol_of_max: float = TIGHT) -> str | None:
    """Within rtol of each reference value plus atol_of_max of the largest; NaN in the reference: unspecified."""
    written = ~torch.isnan(want)
    got, want = got[written], want[written]
    if not bool(torch.isfinite(got).all()):
        return f"{name}: non-finite values"
    if want.numel() == 0:
        return None
    err = (got - want).abs()
    limit = rtol * want.abs() + atol_of_max * want.abs().max()
    bad = int((err > limit).sum())
    return None if bad == 0 else f"{name}: {bad} of {want.numel()} elements off (max error {err.max().item():.3g})"


# ---- K2-size expert weights ----------------------------------------------------------------------------------
# Does TensorRT take a plugin input of over 2^31 elements? K2's stacked gate (and up) weight is 384 x 2048 x 7168 =
# 5.6e9. The case binds one MoeGateUp node with inputs of that size, routes a few tokens to experts at both ends
# (expert 383's weights start 5.6e9 - 14.7e6 elements in), and compares their rows of h with the reference run on
# those experts alone (the sort is stable and keeps the experts' order, so the rows agree). Only the touched experts
# hold data; the full weights are allocated on the device (2 x 5.6 GB), never on the host. Where TensorRT refuses
# the size, the fallback is per-expert-range weight inputs (`k2trt export --expert-ranges N`, export/split_moe.py):
# the same node over one range (128 experts, 1.9e9 elements) is the fallback's case.

K2_EXPERTS, K2_INTER, K2_D = 384, 2048, 7168
K2_RANGE = 128  # export/split_moe.expert_ranges(384, 3): three ranges of 128 experts


@dataclass
class LargeCase:
    num_experts: int  # of the node's weight inputs: 384 (K2's) or one expert range
    touched: list[int]  # experts the routing uses, ascending
    act: str
    activation_quant: int
    x: torch.Tensor  # [1, T, d]
    topk_ids: torch.Tensor  # [1, T, k] into num_experts
    compact: dict[str, torch.Tensor]  # gate/up weights and scales of the touched experts only
    expected: dict[str, torch.Tensor]

    @property
    def label(self) -> str:
        return f"MoeGateUp with {self.num_experts} x {K2_INTER} x {K2_D} expert weights ({self.elements:.1e} elements)"

    @property
    def elements(self) -> int:
        return self.num_experts * K2_INTER * K2_D

    def node_case(self, weights: dict[str, torch.Tensor]) -> NodeCase:
        """The case as a NodeCase whose expert weight inputs are `weights` (device_inputs or shape_inputs)."""
        sorted_pairs, offsets = moe_ref.moe_align_reference(self.topk_ids, self.num_experts)
        n = ["n"]
        return NodeCase("MoeGateUp", self.act, self.activation_quant,
                        {"x": self.x, "sorted_pairs": sorted_pairs, "expert_offsets": offsets, **weights},
                        {"activation_quant": self.activation_quant}, self.expected,
                        {"x": ["B", "T", K2_D], "sorted_pairs": n, "expert_offsets": [self.num_experts + 1],
                         **{k: list(v.shape) for k, v in weights.items()},
                         "h": n + [K2_INTER], "h_scale": n + [self.expected["h_scale"].shape[1]]})

    def device_inputs(self, device) -> dict[str, torch.Tensor]:
        """Full-size weight inputs on `device`: zeros but for the touched experts."""
        out = {}
        for name, compact in self.compact.items():
            full = torch.zeros((self.num_experts, *compact.shape[1:]), dtype=compact.dtype, device=device)
            full[self.touched] = compact.to(device)
            out[name] = full
        return out

    def shape_inputs(self) -> dict[str, torch.Tensor]:
        """Stand-ins of the full weight inputs with their shapes and dtypes and no storage (meta tensors)."""
        return {name: torch.empty((self.num_experts, *c.shape[1:]), dtype=c.dtype, device="meta")
                for name, c in self.compact.items()}


def large_case(num_experts: int = K2_EXPERTS, act: str = "bfloat16", activation_quant: int = PER_TOKEN_GROUP,
               seed: int = 0) -> LargeCase:
    g = torch.Generator().manual_seed(seed)
    touched = sorted({0, 1, num_experts // 2, num_experts - 1})
    t = 3  # tokens, two experts each
    ids = torch.tensor([[[touched[0], touched[-1]], [touched[1], touched[2]], [touched[-1], touched[1]]]],
                       dtype=torch.int32)
    x = torch.randn(1, t, K2_D, generator=g).to(dtype_info(act).torch)
    gw, gs = quantize_weight(torch.randn(len(touched), K2_INTER, K2_D, generator=g) * 0.02)
    uw, us = quantize_weight(torch.randn(len(touched), K2_INTER, K2_D, generator=g) * 0.02)
    local = torch.tensor([touched.index(int(e)) for e in ids.reshape(-1)], dtype=torch.int32).view(ids.shape)
    sp, off = moe_ref.moe_align_reference(local, len(touched))
    h, h_scale = moe_ref.moe_gate_up_reference(x, sp, off, gw, gs, uw, us, activation_quant)
    return LargeCase(num_experts, touched, act, activation_quant, x, ids,
                     {"gate_weight": gw, "gate_scale_inv": gs, "up_weight": uw, "up_scale_inv": us},
                     {"h": h, "h_scale": h_scale})
