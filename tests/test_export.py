"""The exported graphs: ONNX Runtime against the torch reference block by block (fresh random inputs,
max abs error <= 1e-4 x max |ref| in float32), chained, at K2 size, and the checks every export runs."""

import itertools
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from k2trt.config import K2Config
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.export.block_graphs import activation_io, build_block_graph
from k2trt.export.checks import GraphCheckError, check_trt_operators
from k2trt.export.exporter import export
from k2trt.export_manifest import read_manifest
from k2trt.export.onnx_ops import elem as onnx_elem, value_types
from k2trt.export.split_moe import split_moe
from k2trt.export.trt_form import tensorrt_graph
from k2trt.graphs.fp8 import quantize_weight as ref_quantize
from k2trt.graphs import blocks, contracts
from k2trt.graphs import weights as W
from k2trt.tiny.synthetic import RandomWeights
from k2trt.graphs.mask import attention_mask
from k2trt.graphs.reference import ReferenceModel
from k2trt.graphs.rope import rope_tables
from k2trt.runtime.backends.ort import OrtBackend

TINY = K2Config.preset("tiny")
TOL = 1e-4


def tiny_int4():  # called in the tests that need it: parsing an INT4 config imports compressed-tensors (seconds)
    return K2Config.preset("tiny-int4")


@pytest.fixture(scope="module")
def random_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    export(TINY, out, "float32", log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def pair(tiny_ckpt, tiny_export):
    """The embedded default: its checkpoint's weights through its exported graphs."""
    from k2trt.checkpoint import Checkpoint

    weights = Checkpoint.open(tiny_ckpt)
    return ReferenceModel(weights), OrtBackend(tiny_export, weights)


def close(got, ref):
    return (got - ref).abs().max().item() <= TOL * ref.abs().max().item()


# T: decode, a short chunk (attention absorbed), a prefill chunk (decompressed: graphs/blocks.decompress_from)
@pytest.mark.parametrize("b, t, p", list(itertools.product([1, 3], [1, 7, blocks.decompress_from(TINY)], [0, 5])))
def test_blocks_on_onnxruntime_match_reference(pair, b, t, p):
    ref, ort = pair
    g = torch.Generator().manual_seed(100 * b + 10 * t + p)
    x = torch.randn(b, t, TINY.hidden_size, generator=g)
    cache = torch.randn(b, p, TINY.latent_dim, generator=g)
    # ragged: sequence i has i fewer valid past slots
    q_pos = torch.arange(p, p + t).expand(b, t)
    k_pos = torch.arange(p + t).expand(b, p + t)
    valid = k_pos >= torch.arange(b).clamp(max=p).unsqueeze(1)
    mask = attention_mask(q_pos, k_pos, valid)
    cos, sin = rope_tables(TINY, q_pos)
    for layer in (0, 1):  # the dense block and a MoE block
        h_ref, new_ref = ref.block(layer, x, cos, sin, mask, cache)
        h, new = ort.block(layer, x, cos, sin, mask, cache)
        assert close(h, h_ref) and close(new, new_ref), TINY.layer_kind(layer)


def _op_types(nodes) -> list[str]:
    return [n.op_type for n in nodes]


def test_onnxruntime_form_branches_as_the_reference_and_tensorrt_form_stays_absorbed():
    """The ONNX Runtime graph's one If, on T >= blocks.decompress_from (T: the new entries' positions), holds the
    decompressed form when true and the absorbed form when false, recorded from graphs/blocks.py; the TensorRT graph
    holds no If and the absorbed form inline. (Which form ran is invisible in float32 results: the two agree to
    rounding.)"""
    from k2trt.export.onnx_ops import OnnxOps

    ort = build_block_graph(TINY, "dense_block", branches=True)
    (node,) = [n for n in ort.graph.node if n.op_type == "If"]
    branches = {a.name: a.g for a in node.attribute}

    def recorded(form) -> list[str]:
        ops = OnnxOps()
        names = ("q_nope", "q_pe", "latent_cache", "latent_new", "attention_mask", "wkv")
        form(ops, TINY, *(ops.input(n, "float32", []) for n in names))
        return _op_types(ops.nodes)

    assert _op_types(branches["then_branch"].node)[:-1] == recorded(blocks.attend_decompressed)
    assert _op_types(branches["else_branch"].node)[:-1] == recorded(blocks.attend_absorbed)

    # the condition: the new entries' T (the value the graph outputs as latent_new) at least decompress_from
    made = {o: n for n in ort.graph.node for o in n.output}
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in ort.graph.initializer}
    squeeze = made[node.input[0]]
    compare = made[squeeze.input[0]]
    assert (squeeze.op_type, compare.op_type) == ("Squeeze", "GreaterOrEqual")
    shape = made[compare.input[0]]
    attrs = {a.name: a.i for a in shape.attribute}
    latent_new = made["latent_new"].input[0]
    assert shape.op_type == "Shape" and shape.input[0] == latent_new and attrs == {"start": 1, "end": 2}
    assert int(consts[compare.input[1]]) == blocks.decompress_from(TINY)

    trt = build_block_graph(TINY, "dense_block")
    assert "If" not in _op_types(trt.graph.node) and "GreaterOrEqual" not in _op_types(trt.graph.node)


def test_attention_bench_times_both_forms_and_finds_the_crossing(capsys):
    """The bench's two graphs are the block's two forms and agree; its crossing is read off its rows (no timing
    is asserted: the rows' ratios are whatever this machine measures)."""
    from k2trt.tools import attention_bench

    assert attention_bench.main(["--config", "tiny", "--heads", "2", "--tokens", "1", "90", "--past", "0", "64",
                                 "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["past"], r["new"]) for r in out["rows"]] == [(0, 1), (0, 90), (64, 1), (64, 90)]
    assert all(r["rel_err"] < 1e-5 and r["absorbed_ms"] > 0 and r["decompressed_ms"] > 0 for r in out["rows"])
    rows = [dict(r, ratio=ratio) for r, ratio in zip(out["rows"], [0.5, 0.9, 3.0, 0.8])]
    assert attention_bench.crossings(rows) == {0: 1, 64: 90}
    assert attention_bench.crossings([dict(r, ratio=1.5) for r in rows]) == {0: None, 64: None}
    assert "the graphs switch at T = " in attention_bench.table("tiny", TINY, rows)


def test_embedding_and_head_match_reference(pair):
    ref, ort = pair
    ids = torch.randint(0, TINY.vocab_size, (3, 7))
    assert torch.equal(ort.embed(ids), ref.embed(ids))
    h = torch.randn(3, 7, TINY.hidden_size)
    assert close(ort.head(h), ref.head(h))


def test_chained_blocks_reproduce_reference_logits(pair):
    ref, ort = pair
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    mask = attention_mask(pos, pos, torch.ones(2, 9, dtype=torch.bool))
    empty = [torch.zeros(2, 0, TINY.latent_dim)] * TINY.num_hidden_layers
    logits_ref, _ = ref.forward_cached(ids, pos, mask, empty)
    cos, sin = rope_tables(TINY, pos)
    h = ort.embed(ids)
    for layer in range(TINY.num_hidden_layers):
        h, _ = ort.block(layer, h, cos, sin, mask, empty[layer])
    assert close(ort.head(h), logits_ref)


def test_real_size_graph_weight_inputs_add_up():
    k2 = K2Config.preset("kimi-k2")
    for kind, expected in (("moe_block", 17_059_365_248), ("dense_block", 497_500_160)):
        model = build_block_graph(k2, kind, "bfloat16")
        activations = {name for name, _, _ in activation_io(k2, kind, "bfloat16")[0]}
        total = 0
        for vi in model.graph.input:
            if vi.name not in activations and not vi.name.endswith("weight_scale_inv"):
                total += int(np.prod([d.dim_value for d in vi.type.tensor_type.shape.dim]))
        assert total == expected, kind
        assert total == W.parameter_count(W.block_weight_specs(k2, kind))


def test_export_writes_manifest_and_skips_up_to_date(tmp_path):
    lines = []
    m = export(TINY, tmp_path, "float32", log=lines.append)
    assert set(m["graphs"]) == {f"{form}/{k}" for form in ("trt", "ort") for k in BLOCK_KINDS} | {
        "trt/dense_block.prefill", "trt/moe_block.prefill"}  # the attention kinds' decompressed forms
    assert m["layers"] == {"embedding": [], "dense_block": [0], "moe_block": [1, 2, 3], "head": []}
    assert m["opset"] == 20 and m["ir_version"] == 10 and m["config_fingerprint"] == TINY.fingerprint()
    assert read_manifest(tmp_path)["graphs"]["trt/moe_block"]["inputs"][0]["shape"] == ["B", "T", 128]
    lines.clear()
    export(TINY, tmp_path, "float32", log=lines.append)
    assert sum("up to date" in line for line in lines) == len(BLOCK_KINDS)
    assert not list(tmp_path.rglob("*.tmp"))  # nothing half-written left behind


def test_dynamic_dims_are_named_the_same_everywhere(random_export):
    m = read_manifest(random_export)
    for entry in m["graphs"].values():
        for io in entry["inputs"] + entry["outputs"]:
            for d in io["shape"]:
                # P: a gathered cache's slots (ONNX Runtime); pages, rows: the page tables and the pool (TensorRT)
                assert isinstance(d, int) or d in ("B", "T", "P", "P+T", "pages", "rows"), (entry["file"], io)


def _follows_contract(node, seen: set) -> None:
    c = contracts.CONTRACTS[node.op_type]
    seen.add(node.op_type)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert set(attrs) == {"plugin_namespace", "plugin_version", *c.attribute_names()}, node.name
    assert attrs["plugin_namespace"] == contracts.NAMESPACE.encode()
    assert len(node.input) == len(c.inputs) and len(node.output) == len(c.outputs)


def test_custom_nodes_follow_their_contracts():
    seen = set()
    for cfg in (TINY, tiny_int4()):
        for kind in ("moe_block", *MOE_PART_KINDS):
            for node in build_block_graph(cfg, kind, experts=96).graph.node:
                if node.domain == contracts.NAMESPACE:
                    _follows_contract(node, seen)
    assert seen == {c.op_type for c in contracts.RECORDED}


@pytest.mark.parametrize("act, aq", [("bfloat16", 1), ("float32", 0)])
def test_trt_graphs_hold_one_plugin_per_kernel(act, aq):
    """The TensorRT-bound form, both attention forms: MoeFp8 and the paged attention expanded, every custom node a
    TensorRT contract, dtypes as the contract says for this activation dtype and FP8 mode (shape inference runs
    through the annotations)."""
    seen = set()
    for cfg, form in ((TINY, "decode"), (TINY, "prefill"), (tiny_int4(), "decode")):
        model = tensorrt_graph(cfg, "moe_block", act, aq, form=form)
        check_trt_operators(model, "trt/moe_block")
        types = {name: t.elem_type for name, t in value_types(model).items()}
        for node in model.graph.node:
            if node.domain != contracts.NAMESPACE:
                continue
            _follows_contract(node, seen)
            c = contracts.CONTRACTS[node.op_type]
            for port, value in zip(c.inputs + c.outputs, list(node.input) + list(node.output)):
                assert types[value] == onnx_elem(port.dtype_for(act, aq)), (node.name, port.name)
    assert seen == {c.op_type for c in contracts.TENSORRT}


def test_split_moe_computes_moefp8():
    """The four stage nodes, run in graph order with their torch references on the values the graph wires
    between them, give exactly what the MoeFp8 node they replace gives."""
    from k2trt.graphs import moe_ref
    from k2trt.dtypes import BY_ONNX

    g = torch.Generator().manual_seed(5)
    e, d, i = TINY.n_routed_experts, TINY.hidden_size, TINY.moe_intermediate_size
    ws = [ref_quantize(torch.randn(e, *shape, generator=g) / 10) for shape in ((i, d), (i, d), (d, i))]
    for aq in (0, 1):
        recorded = build_block_graph(TINY, "moe_block", "float32", aq)
        (moe_node,) = [n for n in recorded.graph.node if n.op_type == "MoeFp8"]
        x = torch.randn(2, 3, d, generator=g)
        ids = torch.randint(0, e, (2, 3, TINY.num_experts_per_tok), generator=g, dtype=torch.int32)
        w = torch.rand(2, 3, TINY.num_experts_per_tok, generator=g)
        values = dict(zip(moe_node.input, [x, ids, w, *ws[0], *ws[1], *ws[2]]))
        stages = {"MoeAlign": lambda v, a: moe_ref.moe_align_reference(v[0], a["num_experts"]),
                  "MoeGateUp": lambda v, a: moe_ref.moe_gate_up_reference(*v, a["activation_quant"]),
                  "MoeDown": lambda v, a: moe_ref.moe_down_reference(*v, a["activation_quant"],
                                                                      BY_ONNX[a["out_dtype"]].torch),
                  "MoeCombine": lambda v, a: moe_ref.moe_combine_reference(*v)}
        for node in split_moe(recorded).graph.node:
            if node.op_type in stages:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                out = stages[node.op_type]([values[v] for v in node.input], attrs)
                values.update(zip(node.output, out if isinstance(out, tuple) else (out,)))
        assert torch.equal(values[moe_node.output[0]], moe_ref.moe_fp8_reference(x, ids, w, *ws[0], *ws[1], *ws[2],
                                                                                   aq))


def test_operator_check_rejects_a_runtime_dequantize_scale():
    model = build_block_graph(TINY, "head")
    model.graph.node.append(helper.make_node("DequantizeLinear", ["lm_head.weight", "hidden_states"], ["dq"],
                                             name="planted"))
    with pytest.raises(GraphCheckError, match="scale to be a build-time constant"):
        check_trt_operators(model, "trt/head")


def test_kv_b_enters_dequantized_and_prepared():
    model = build_block_graph(TINY, "dense_block")
    names = {i.name for i in model.graph.input}
    assert "self_attn.kv_b_proj.weight.dequant" in names and "self_attn.kv_b_proj.weight" not in names
    assert not [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    from k2trt.export.onnx_ops import weight_prep

    assert weight_prep(model) == {"self_attn.kv_b_proj.weight.dequant": {
        "op": "dequant", "from": ["self_attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight_scale_inv"]}}


@pytest.mark.parametrize("op, domain, why", [
    ("Compress", "", "not in TensorRT's ONNX operator support list"),
    ("If", "", "control flow"),
    ("MoE", "com.microsoft", "not parsed by TensorRT"),
])
def test_operator_check_rejects_planted_node(op, domain, why):
    model = build_block_graph(TINY, "head")
    model.graph.node.append(helper.make_node(op, ["hidden_states"], ["planted_out"], name="planted", domain=domain))
    with pytest.raises(GraphCheckError, match=why) as e:
        check_trt_operators(model, "trt/head")
    assert "'planted'" in str(e.value)


def test_lowered_graphs_have_no_custom_nodes(random_export):
    m = read_manifest(random_export)
    for kind in BLOCK_KINDS:
        g = onnx.load(str(random_export / m["graphs"][f"ort/{kind}"]["file"]))
        assert not [n for n in g.graph.node if n.domain == contracts.NAMESPACE]


def test_architecture_doc_shows_the_contracts():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "ARCHITECTURE.md").read_text()
    begin, end = doc.index("<!-- contracts:begin"), doc.index("<!-- contracts:end -->")
    assert contracts.markdown_table() in doc[begin:end]


def test_k2_head_dimensions_on_onnxruntime(tmp_path):
    """K2's own per-head shapes (q_lora 1536, kv_lora 512, nope/rope/v 128/64/128, kv_a 576 rows = a partial
    scale block) with fewer heads, a smaller hidden size and 16 experts, so CPU memory stays small."""
    import dataclasses

    cfg = dataclasses.replace(K2Config.preset("kimi-k2"), hidden_size=512, num_attention_heads=2,
                              num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=256,
                              n_routed_experts=16, num_hidden_layers=2, vocab_size=512, bos_token_id=0,
                              eos_token_id=1)
    export(cfg, tmp_path, "float32", log=lambda *a: None)
    weights = RandomWeights(cfg, seed=3)
    ref, ort = ReferenceModel(weights), OrtBackend(tmp_path, weights)
    b, t, p = 2, 5, 4
    x = torch.randn(b, t, cfg.hidden_size)
    cache = torch.randn(b, p, cfg.latent_dim)
    q_pos = torch.arange(p, p + t).expand(b, t)
    mask = attention_mask(q_pos, torch.arange(p + t).expand(b, p + t), torch.ones(b, p + t, dtype=torch.bool))
    cos, sin = rope_tables(cfg, q_pos)
    assert cfg.latent_dim == 576
    for layer in (0, 1):
        h_ref, new_ref = ref.block(layer, x, cos, sin, mask, cache)
        h, new = ort.block(layer, x, cos, sin, mask, cache)
        assert close(h, h_ref) and close(new, new_ref), cfg.layer_kind(layer)


def test_exporter_code_change_makes_graphs_stale(tmp_path, monkeypatch):
    from k2trt.export import manifest_writer as M

    export(TINY, tmp_path, "float32", log=lambda *a: None)
    assert M.load_if_current(tmp_path, TINY, "float32", 1) is not None
    monkeypatch.setattr(M, "exporter_fingerprint", lambda: "another-exporter")
    assert M.load_if_current(tmp_path, TINY, "float32", 1) is None
