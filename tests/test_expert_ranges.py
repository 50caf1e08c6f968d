"""Per-expert-range weight inputs: the fallback for a TensorRT that refuses plugin inputs over 2^31 elements
(export/split_moe.py `expert_ranges`). The split graph is evaluated node by node — its standard ONNX ops in torch,
its plugin nodes by their references (graphs/moe_ref.py) — against the unsplit MoeFp8 reference; the runtime binds
range inputs as views of the stacked tensors (runtime/backends/graph_weights.py)."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from tolerances import TIGHT, assert_close

from k2trt.config import K2Config
from k2trt.dtypes import BY_ONNX
from k2trt.dtypes import dtype as dtype_info
from k2trt.export.block_graphs import IR_VERSION, OPSET, build_block_graph
from k2trt.export.checks import check_onnx, check_trt_operators
from k2trt.export.onnx_ops import plugin_attributes
from k2trt.export.split_moe import INT_MAX_ELEMENTS, expert_ranges, ranges_needed, split_moe
from k2trt.export_manifest import expert_range_input, parse_expert_range
from k2trt.graphs import contracts, moe_ref
from k2trt.graphs.fp8 import quantize_weight

E, D, INTER, T, K = 40, 256, 128, 6, 4


def test_range_rules():
    assert expert_ranges(384, 3) == [(0, 128), (128, 256), (256, 384)]
    assert expert_ranges(384, 1) == [(0, 384)] and expert_ranges(40, 3) == [(0, 16), (16, 32), (32, 40)]
    assert ranges_needed(384, 2048 * 7168) == 3  # K2: 384 x 2048 x 7168 = 5.6e9 > 2^31 - 1; 128 experts: 1.9e9
    assert ranges_needed(384, 128 * 128) == 1
    assert max(b - a for a, b in expert_ranges(384, 3)) * 2048 * 7168 <= INT_MAX_ELEMENTS
    assert parse_expert_range(expert_range_input("mlp.experts.up_proj.weight", 128, 256)) == \
        ("mlp.experts.up_proj.weight", 128, 256)
    assert parse_expert_range("mlp.experts.up_proj.weight") is None and parse_expert_range("a@b:c") is None


def _moe_model(act: str, aq: int) -> onnx.ModelProto:
    elem = dtype_info(act).onnx
    f8, f32 = onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("x", elem, [1, T, D]),
           helper.make_tensor_value_info("ids", onnx.TensorProto.INT32, [1, T, K]),
           helper.make_tensor_value_info("w", f32, [1, T, K])]
    for name, shape in (("gate", [E, INTER, D]), ("up", [E, INTER, D]), ("down", [E, D, INTER])):
        ins += [helper.make_tensor_value_info(f"{name}.weight", f8, shape),
                helper.make_tensor_value_info(f"{name}.scale", f32, [E, -(-shape[1] // 128), -(-shape[2] // 128)])]
    node = helper.make_node("MoeFp8", [i.name for i in ins], ["y"], name="moe", domain=contracts.NAMESPACE,
                            activation_quant=aq, **plugin_attributes())
    graph = helper.make_graph([node], "moe", ins, [helper.make_tensor_value_info("y", elem, [1, T, D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(contracts.NAMESPACE, 1)])
    model.ir_version = IR_VERSION
    return model


def _evaluate(model: onnx.ModelProto, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the split graph: its standard ops in torch, its plugin nodes by the stage references."""
    values = dict(feeds)
    for node in model.graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        i = [values[n] for n in node.input]
        op = node.op_type
        if op == "Constant":
            out = [torch.from_numpy(numpy_helper.to_array(a["value"]).copy())]
        elif op in ("GreaterOrEqual", "Less", "And", "Sub", "Add"):
            fn = {"GreaterOrEqual": torch.ge, "Less": torch.lt, "And": torch.logical_and, "Sub": torch.sub,
                  "Add": torch.add}[op]
            out = [fn(*i)]
        elif op == "Where":
            out = [torch.where(*i)]
        elif op == "Cast":
            out = [i[0].to(BY_ONNX[a["to"]].torch)]
        elif op == "MoeAlign":
            out = list(moe_ref.moe_align_reference(i[0], a["num_experts"]))
        elif op == "MoeGateUp":
            out = list(moe_ref.moe_gate_up_reference(*i, a["activation_quant"]))
        elif op == "MoeDown":
            out = [moe_ref.moe_down_reference(*i, a["activation_quant"], BY_ONNX[a["out_dtype"]].torch)]
        elif op == "MoeCombine":
            out = [moe_ref.moe_combine_reference(*i).reshape(1, T, D)]
        else:
            raise AssertionError(f"unexpected node {op}")
        values.update(zip(node.output, out))
    return values


@pytest.mark.parametrize("act, aq", [("float32", 0), ("float32", 1), ("bfloat16", 1)])
def test_expert_ranges_compute_what_the_stacked_experts_do(act, aq):
    g = torch.Generator().manual_seed(3)
    dt = dtype_info(act).torch
    x = torch.randn(1, T, D, generator=g).to(dt)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32).view(1, T, K)
    ids[0, 0] = torch.tensor([0, 15, 16, 39], dtype=torch.int32)  # both ends of every range
    w = torch.rand(1, T, K, generator=g) + 0.1
    experts = {}
    for name, (n, k) in (("gate", (INTER, D)), ("up", (INTER, D)), ("down", (D, INTER))):
        experts[f"{name}.weight"], experts[f"{name}.scale"] = quantize_weight(torch.randn(E, n, k, generator=g) * 0.1)
    stacked = {"x": x, "ids": ids, "w": w, **experts}
    split = split_moe(_moe_model(act, aq), expert_ranges=3)
    names = [i.name for i in split.graph.input]
    assert sum(parse_expert_range(n) is not None for n in names) == 3 * 6 and "gate.weight" not in names
    feeds = {}
    for n in names:  # range inputs as the runtime binds them: slices of the stacked tensors
        r = parse_expert_range(n)
        feeds[n] = stacked[n] if r is None else stacked[r[0]][r[1]:r[2]]
    y = _evaluate(split, feeds)["y"]
    want = moe_ref.moe_fp8_reference(x, ids, w, *experts.values(), activation_quant=aq)
    assert y.dtype == dt
    if act == "float32":
        assert_close(y, want, TIGHT)
    else:  # each range's sum is rounded to the activation dtype before the float32 sum: one rounding per range
        assert_close(y.float(), want.float(), 3 * torch.finfo(dt).eps)


def test_k2_graph_in_expert_ranges_is_a_valid_tensorrt_graph_of_small_inputs():
    cfg = K2Config.preset("kimi-k2")
    model = split_moe(build_block_graph(cfg, "moe_block", "bfloat16", 1), expert_ranges=3)
    check_onnx(model, "trt/moe_block")
    check_trt_operators(model, "trt/moe_block")
    for vi in model.graph.input:
        elements = 1
        for d in vi.type.tensor_type.shape.dim:
            elements *= d.dim_value or 1
        assert elements <= INT_MAX_ELEMENTS, vi.name
    assert sum(n.op_type == "MoeGateUp" for n in model.graph.node) == 3


def test_range_inputs_are_bound_as_views_of_the_stacked_tensors():
    from k2trt.runtime.backends.graph_weights import graph_weights, source_names

    stacked = torch.arange(40 * 6, dtype=torch.float32).view(40, 2, 3)
    names = [expert_range_input("mlp.experts.gate_proj.weight_scale_inv", a, b) for a, b in expert_ranges(40, 3)]
    entry = {"kind": "moe_block", "weights": names, "prep": {}}
    assert source_names(entry) == ["mlp.experts.gate_proj.weight_scale_inv"]
    out = graph_weights(entry, {"mlp.experts.gate_proj.weight_scale_inv": stacked}, torch.float32)
    assert [tuple(out[n].shape) for n in names] == [(16, 2, 3), (16, 2, 3), (8, 2, 3)]
    assert out[names[1]].data_ptr() == stacked[16].data_ptr()  # a view: no copy of K2's 5.6 GB
    assert torch.equal(torch.cat([out[n] for n in names]), stacked)
