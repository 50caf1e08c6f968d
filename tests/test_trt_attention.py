"""The paged attention in the TensorRT-bound graphs: each MlaPaged* node expanded into its two plugins
(export/split_attention.py), the stages' contracts composing to the node's, their JIT bodies (the kernels of
runtime/kernels/mla_*.py, under the interpreter) against the stage references, and the decode's split rule on ints
and on TensorRT shape expressions alike. The AOT launches of the same stages run through the stand-in in
tests/test_trt_glue.py (test_every_aot_kernel_matches_its_reference)."""

from __future__ import annotations

import argparse
import sys

import onnx
import pytest
import torch
import trt_standin as S

from k2trt.config import K2Config
from k2trt.export.checks import check_onnx, check_trt_operators
from k2trt.export.trt_form import forms, tensorrt_graph
from k2trt.graphs import contracts, mla_ref
from k2trt.runtime.tensorrt import plugins
from k2trt.runtime.tensorrt.plugin_cases import MLA_LATENT, MLA_PAGE, mismatches, node_cases

TINY = K2Config.preset("tiny")


def _custom(model):
    return [n for n in model.graph.node if n.domain == contracts.NAMESPACE]


@pytest.mark.parametrize("form, stages", [("decode", ("MlaDecodeSplit", "MlaDecodeMerge")),
                                          ("prefill", ("MlaDecompress", "MlaAttend"))])
def test_each_paged_node_becomes_its_two_stages(form, stages):
    """The block's attention node is gone; its two stages take the contract's ports in the kernels' order, the
    pool's scale a float32 constant 1, the second stage the first one's output; every other node stays."""
    model = tensorrt_graph(TINY, "moe_block", "bfloat16", 1, form=form)
    check_onnx(model, form)
    check_trt_operators(model, form)
    ops = [n.op_type for n in _custom(model)]
    assert [op for op in ops if op.startswith("Mla")] == list(stages)
    assert not {c.op_type for c in contracts.PAGED} & set(ops)
    first, second = (n for n in _custom(model) if n.op_type in stages)
    for node in (first, second):
        assert len(node.input) == len(contracts.CONTRACTS[node.op_type].inputs)
        assert len(node.output) == len(contracts.CONTRACTS[node.op_type].outputs)
    assert set(first.output) <= set(second.input)
    graph_inputs = {i.name for i in model.graph.input}
    assert {"kv_pool", "page_table", "ctx_lens", "n_new"} <= graph_inputs
    assert not {"latent_cache", "attention_mask"} & graph_inputs  # no gathered cache, no mask
    if form == "decode":
        scale_name = first.input[2]
    else:
        scale_name = first.input[1]
    (const,) = [n for n in model.graph.node if n.output == [scale_name]]
    value = onnx.numpy_helper.to_array(const.attribute[0].t)
    assert value.dtype == "float32" and value.tolist() == [1.0]


def test_only_attention_kinds_have_a_prefill_form():
    assert forms("dense_block") == forms("moe_block") == forms("moe_front") == ("decode", "prefill")
    assert forms("embedding") == forms("head") == forms("moe_experts") == ("decode",)
    with pytest.raises(ValueError, match="no 'prefill' form"):
        tensorrt_graph(TINY, "head", "bfloat16", 1, form="prefill")


def test_the_decode_stages_compose_to_the_paged_decode():
    """Merging the split reference's partials is MlaPagedDecode's attention, for several split counts (more
    splits than pages included: empty splits weigh nothing)."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(8 * 16, 80, generator=g)
    tables = torch.tensor([[5, 2, 7], [0, 0, 0], [2, 6, 1]], dtype=torch.int32)
    lens, n_new = torch.tensor([17, 0, 48], dtype=torch.int32), torch.tensor([3, 2, 1], dtype=torch.int32)
    new, q = torch.randn(3, 3, 80, generator=g), torch.randn(3, 3, 2, 80, generator=g)
    want = mla_ref.paged_mla_decode_reference(q, pool, tables, lens, 0.2, 16, latent_dim=64, new=new, n_new=n_new)
    for splits in (1, 2, 5):
        acc, ml = mla_ref.split_partials_reference(q, pool, tables, lens, new, n_new, 0.2, 16, splits, 64)
        torch.testing.assert_close(mla_ref.merge_partials_reference(acc, ml, torch.float32), want)


@pytest.mark.parametrize("act", contracts.ACTIVATION_DTYPES)
def test_mla_plugin_bodies_match_their_references(act):
    """The JIT bodies of the four plugins (what impl runs on TensorRT's stream) on k2trt doctor's cases, outputs
    NaN-poisoned: every written value within the case's tolerance, the decompression's unwritten rows left."""
    from k2trt.runtime.kernels import mla_decode, mla_prefill

    cases = {c.op_type: c for c in node_cases(act, 1) if c.op_type.startswith("Mla")}
    assert set(cases) == {c.op_type for c in contracts.MLA_STAGES}

    def poisoned(case):
        return {k: torch.full_like(v, float("nan")) for k, v in case.expected.items()}

    c = cases["MlaDecodeSplit"]
    i, out = c.inputs, poisoned(c)
    mla_decode.decode_split(i["q_full"], i["kv_pool"], i["kv_scale"], i["page_table"], i["ctx_lens"],
                            i["latent_new"], i["n_new"], out["part_acc"], out["part_ml"],
                            softmax_scale=c.attrs["softmax_scale"], page_tokens=MLA_PAGE, latent_dim=MLA_LATENT)
    assert not mismatches(c, out)
    c = cases["MlaDecodeMerge"]
    out = poisoned(c)
    mla_decode.decode_merge(c.inputs["part_acc"], c.inputs["part_ml"], out["o_lat"])
    assert not mismatches(c, out)
    c = cases["MlaDecompress"]
    i, out = c.inputs, poisoned(c)
    mla_prefill.prefill_decompress(i["kv_pool"], i["kv_scale"], i["page_table"], i["ctx_lens"], i["n_new"],
                                   i["latent_new"], i["kv_b"], out["kv"], page_tokens=MLA_PAGE,
                                   latent_dim=MLA_LATENT, config=mla_prefill.MlaPrefillConfig(decompress_k=32))
    assert not mismatches(c, out)
    assert torch.isnan(out["kv"][1, 2:].float()).all()  # sequence 1 holds 0 + 2 positions: nothing else written
    c = cases["MlaAttend"]
    i, out = c.inputs, poisoned(c)
    mla_prefill.prefill_attend(i["q"], i["kv_pool"], i["kv_scale"], i["page_table"], i["ctx_lens"], i["n_new"],
                               i["latent_new"], i["kv"], out["o"], softmax_scale=c.attrs["softmax_scale"],
                               page_tokens=MLA_PAGE, latent_dim=MLA_LATENT)
    assert not mismatches(c, out)


def test_the_split_rule_on_ints_and_on_shape_expressions(monkeypatch):
    """decode_splits gives TensorRT an expression that evaluates to what it gives on ints: the grid about twice
    an H100's SMs, at most one split per 16 positions of the table, at most MAX_SPLITS, at least 1."""
    from k2trt.runtime.kernels.mla_decode import MAX_SPLITS

    trtp = S.TensorRTPlugin()
    monkeypatch.setitem(sys.modules, "tensorrt", argparse.Namespace(plugin=trtp))
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    with S.expression_builder():
        for b, t, pages in ((1, 1, 1), (1, 1, 512), (8, 1, 512), (64, 1, 512), (3, 9, 2), (1, 1, 0)):
            want = plugins.decode_splits(b, t, 64, pages, 64)
            got = plugins.decode_splits(S.dim(b, True), S.dim(t, True), 64, S.dim(pages, True), 64)
            assert got.value == want and not got.constant, (b, t, pages)
            assert 1 <= want <= MAX_SPLITS
    assert plugins.decode_splits(1, 1, 64, 512, 64) == MAX_SPLITS  # one long sequence: as many splits as allowed
    assert plugins.decode_splits(64, 1, 64, 512, 64) == 2  # 64 sequences × 4 row blocks fill the GPU already
    assert plugins.decode_splits(1, 1, 64, 1, 64) == 4  # a one-page table: a split per 16 positions


def test_the_tensorrt_backend_binds_the_pool_and_picks_the_form_by_t():
    """TrtBackend hands its attention engines the layer's pool itself (no copy), the tables and lengths as int32,
    the dims its outputs follow, and picks the prefill engine from blocks.decompress_from new positions; a gathered
    cache, a pool past the engines' rows and tables past their pages are refused in one line (no GPU needed)."""
    from k2trt.errors import K2Error
    from k2trt.graphs.blocks import PagedCache, decompress_from
    from k2trt.runtime.backends.tensorrt import TrtBackend
    from k2trt.runtime.tensorrt.profiles import ProfileSpec

    be = TrtBackend.__new__(TrtBackend)  # the parts that need no engine
    be.cfg, be.decompress_from = TINY, decompress_from(TINY)
    be.spec = ProfileSpec(max_batch=2, max_seq=256, max_prefill=256, opt_prefill=128, opt_seq=128)
    be.device, be.act_dtype = torch.device("cpu"), torch.float32
    assert [be._form("moe_block", t) for t in (1, 9, be.decompress_from - 1)] == ["moe_block"] * 3
    assert be._form("dense_block", be.decompress_from) == "dense_block.prefill"
    assert be._form("moe_front", 200) == "moe_front.prefill"

    b, t = 2, 3
    hidden, rope = torch.zeros(b, t, TINY.hidden_size), torch.zeros(b, t, TINY.qk_rope_head_dim // 2)
    pool = torch.zeros(be.spec.pool_pages * 64, TINY.latent_dim)
    table = torch.tensor([[3, 1, 0, 0], [2, 0, 0, 0]])
    cache = PagedCache(pool, table, torch.tensor([70, 5]), torch.tensor([3, 1]), 64)
    inputs, dims = be._attention_inputs(hidden, rope, rope, cache)
    assert inputs["kv_pool"] is pool  # read where it lies
    assert all(inputs[n].dtype == torch.int32 for n in ("page_table", "ctx_lens", "n_new"))
    assert dims == {"B": b, "T": t, "pages": 4, "rows": pool.shape[0]}
    assert "latent_cache" not in inputs and "attention_mask" not in inputs
    with pytest.raises(K2Error, match="give a PagedCache"):
        be._attention_inputs(hidden, rope, rope, torch.zeros(b, 16, TINY.latent_dim))
    with pytest.raises(K2Error, match="the engines at most"):
        be._attention_inputs(hidden, rope, rope, cache._replace(pool=torch.zeros(pool.shape[0] + 64, pool.shape[1])))
    with pytest.raises(K2Error, match="outside the engines' range 1..4"):
        be._attention_inputs(hidden, rope, rope, cache._replace(page_table=torch.zeros(b, 5, dtype=torch.int32)))
