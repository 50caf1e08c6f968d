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

Expert ranges (`expert_ranges` > 1) are the fallback for a TensorRT that refuses plugin inputs over 2^31 elements
(K2's stacked gate weight is 384 x 2048 x 7168 = 5.6e9; `k2trt doctor` checks): the experts are split into ranges,
each range a pipeline of the four stages over its own weight inputs, `<stacked>@<first>:<stop>` (bound as views of
the stacked tensor), fed the routing remapped to the range — ids outside it go to its first expert with weight 0
— and the ranges' outputs summed in float32. Since every range runs every pair, the GEMMs do `ranges` times the
rows (their weight reads, which bound decode, grow by one expert per range); exact to one rounding per range.
INT4 experts never need them: K2-Thinking's stacked packed gate is 384 x 2048 x 896 = 7.0e8 elements.
"""

from __future__ import annotations

import onnx
from onnx import helper

from k2trt.export.node_expansion import NodeExpansion
from k2trt.export.onnx_ops import dims
from k2trt.graphs import contracts


INT_MAX_ELEMENTS = 2**31 - 1
RANGE_STEP = 16  # ranges start at multiples of 16 experts: views of the stacked tensors stay 256-byte aligned


def expert_ranges(num_experts: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous expert ranges [first, stop), as even as steps of RANGE_STEP experts allow."""
    if parts < 1 or parts > num_experts:
        raise ValueError(f"expert ranges: {parts} for {num_experts} experts")
    if parts == 1:
        return [(0, num_experts)]
    step = -(-num_experts // parts)
    aligned = -(-step // RANGE_STEP) * RANGE_STEP
    if -(-num_experts // aligned) == parts:  # aligned starts where that still makes `parts` ranges
        step = aligned
    bounds = list(range(0, num_experts, step)) + [num_experts]
    return list(zip(bounds[:-1], bounds[1:]))


def ranges_needed(num_experts: int, per_expert_elements: int, limit: int = INT_MAX_ELEMENTS) -> int:
    """The fewest expert ranges whose every weight input holds at most `limit` elements (K2: 3 of 128 experts)."""
    parts = 1
    while max(b - a for a, b in expert_ranges(num_experts, parts)) * per_expert_elements > limit:
        parts += 1
    return parts


def pairs_dim(token_dims: list, k: int) -> str:
    """The (token, expert) pairs of x's leading dims and top-k, as a dim: "B*T*8" for a block's [B, T] tokens, "R"
    for the experts graph of an expert-parallel block (rows [R, 1], top-1)."""
    return "*".join(str(v) for v in [*token_dims, k] if v != 1)


class _Split(NodeExpansion):
    def __init__(self, model: onnx.ModelProto, parts: int = 1):
        super().__init__(model)
        self.parts = parts
        self.ranged_inputs: dict[str, list[onnx.ValueInfoProto]] = {}  # stacked input -> its range inputs

    def op(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def const(self, name: str, value, elem: int) -> str:
        return self.op("Constant", [], name, value=helper.make_tensor(name, elem, [], [value]))

    def range_input(self, name: str, first: int, stop: int) -> str:
        """The graph input holding experts [first, stop) of the stacked weight input `name`."""
        from k2trt.export_manifest import expert_range_input

        t = self.types[name]
        ranged = expert_range_input(name, first, stop)
        vi = helper.make_tensor_value_info(ranged, t.elem_type, [stop - first] + dims(t)[1:])
        self.ranged_inputs.setdefault(name, []).append(vi)
        return ranged

    def expand(self, node: onnx.NodeProto) -> None:
        if self.parts > 1:
            return self.expand_ranges(node)
        self.pipeline(node, f"{node.name}/", list(node.input), list(node.output))

    def expand_ranges(self, node: onnx.NodeProto) -> None:
        """One pipeline per expert range, on remapped routing; the outputs summed in float32."""
        x, ids, wts, *weights = node.input
        e = dims(self.types[weights[0]])[0]
        act = self.types[x].elem_type
        p = f"{node.name}/"
        zero_id = self.const(p + "zero_id", 0, onnx.TensorProto.INT32)
        zero_w = self.const(p + "zero_w", 0.0, onnx.TensorProto.FLOAT)
        partial = []
        for first, stop in expert_ranges(e, self.parts):
            r = f"{p}experts_{first}_{stop}/"
            lo = self.const(r + "first", first, onnx.TensorProto.INT32)
            hi = self.const(r + "stop", stop, onnx.TensorProto.INT32)
            inside = self.op("And", [self.op("GreaterOrEqual", [ids, lo], r + "ge"),
                                     self.op("Less", [ids, hi], r + "lt")], r + "inside")
            local = self.op("Where", [inside, self.op("Sub", [ids, lo], r + "shifted"), zero_id], r + "ids")
            weight = self.op("Where", [inside, wts, zero_w], r + "weights")
            ranged = [self.range_input(w, first, stop) for w in weights]
            y = r + "y"
            self.value_info.append(helper.make_tensor_value_info(y, act, dims(self.types[node.output[0]])))
            self.pipeline(node, r, [x, local, weight, *ranged], [y], num_experts=stop - first)
            partial.append(self.op("Cast", [y], r + "y32", to=onnx.TensorProto.FLOAT))
        total = partial[0]
        for i, y in enumerate(partial[1:], 1):
            total = self.op("Add", [total, y], f"{p}sum{i}")
        self.op("Cast", [total], node.output[0], to=act)

    def pipeline(self, node: onnx.NodeProto, p: str, inputs: list[str], outputs: list[str],
                 num_experts: int | None = None) -> None:
        x, ids, wts, gw, gs, uw, us, dw, ds = inputs
        node_inputs = list(node.input)
        aq = next(a.i for a in node.attribute if a.name == "activation_quant")
        act = self.types[x].elem_type
        e, inter, d = dims(self.types[node_inputs[3]])
        e = e if num_experts is None else num_experts
        k = dims(self.types[node_inputs[1]])[-1]
        gs_dims = dims(self.types[node_inputs[4]])
        if not all(isinstance(v, int) for v in (e, inter, d, k)):
            raise ValueError(f"{node.name}: MoeFp8 needs static expert shapes and top-k, "
                             f"got E={e} I={inter} d={d} k={k}")
        h_type = onnx.TensorProto.FLOAT8E4M3FN if aq == contracts.W8A8 else act
        n = pairs_dim(dims(self.types[x])[:-1], k)
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
        self.stage(contracts.MOE_COMBINE, p + "combine", [pair_out, wts], outputs)

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
        n = pairs_dim(dims(self.types[x])[:-1], k)
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

    def expansions(self):
        return {contracts.MOE_FP8.op_type: self.expand, contracts.MOE_INT4.op_type: self.expand_int4}

    def finish(self, g: onnx.GraphProto) -> None:
        if self.ranged_inputs:  # each stacked expert input becomes its range inputs, in place
            inputs = []
            for vi in g.input:
                inputs += self.ranged_inputs.get(vi.name, [vi])
            del g.input[:]
            g.input.extend(inputs)


def split_moe(model: onnx.ModelProto, expert_ranges: int = 1) -> onnx.ModelProto:
    """A copy of `model` with every MoeFp8 node replaced by MoeAlign, MoeGateUp, MoeDown and MoeCombine — one such
    pipeline per expert range when `expert_ranges` > 1 (the module docstring) — and every MoeInt4 node by MoeAlign,
    MoeGateUpInt4, MoeDownInt4 and MoeCombine."""
    return _Split(model, expert_ranges).run()
