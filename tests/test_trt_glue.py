"""The TensorRT glue that runs without TensorRT: profiles, the engine manifest and its checks, the plugin
descriptions against the node contracts and the exported nodes, the plugins registered with and parsed by a
stand-in that follows TensorRT's own source (tests/trt_standin.py), every AOT kernel launched as TensorRT would
launch it (under Triton's interpreter) and compiled to PTX, and the one-line errors where TensorRT is missing."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import onnx
import pytest
import torch
import trt_standin as S
from tolerances import assert_close

from k2trt.cli import main
from k2trt.config import K2Config
from k2trt.errors import K2Error, MissingDependency
from k2trt import export_manifest
from k2trt.export.block_graphs import build_block_graph
from k2trt.export.onnx_ops import dims, value_types
from k2trt.dtypes import BY_ONNX
from k2trt.graphs import contracts
from k2trt.graphs.fp8 import fp8_block_linear as reference_linear
from k2trt.graphs.fp8 import quantize_weight
from k2trt.runtime.engines import builder as B
from k2trt.runtime.tensorrt import engine_manifest as EM
from k2trt.runtime.tensorrt import plugins
from k2trt.runtime.tensorrt.profiles import (DECODE, PREFILL, Profile, ProfileError, ProfileSpec, ShapeRange,
                                        add_profile_arguments, check_call_shape, eval_dim, graph_profiles,
                                        profile_index, spec_from_args)

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
TINY = K2Config.preset("tiny")

# A small manifest graph entry: every kind of dim the block graphs use, a static non-weight input, a weight.
TOY_GRAPH = {
    "inputs": [
        {"name": "hidden_states", "dtype": "bfloat16", "shape": ["B", "T", 8]},
        {"name": "attention_mask", "dtype": "float32", "shape": ["B", "T", "P+T"]},
        {"name": "latent_cache", "dtype": "bfloat16", "shape": ["B", "P", 12]},
        {"name": "table", "dtype": "float32", "shape": [3]},
        {"name": "w", "dtype": "float8_e4m3fn", "shape": [4, 8]},
    ],
    "outputs": [{"name": "y", "dtype": "bfloat16", "shape": ["B", "T", 4]}],
    "weights": ["w"],
    "prep": {},
}
TOY_SPEC = ProfileSpec(max_batch=4, max_seq=64, max_prefill=16, opt_batch=2, opt_prefill=8, opt_seq=32)


# ---- profiles ----------------------------------------------------------------------------------------------

def test_profiles_have_exact_ranges_for_every_dynamic_input():
    prefill, decode = graph_profiles(TOY_SPEC, TOY_GRAPH)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert prefill.shapes == {
        "hidden_states": ShapeRange((1, 1, 8), (2, 8, 8), (4, 16, 8)),
        "attention_mask": ShapeRange((1, 1, 2), (2, 8, 40), (4, 16, 80)),
        "latent_cache": ShapeRange((1, 1, 12), (2, 32, 12), (4, 64, 12)),
    }
    assert decode.shapes == {
        "hidden_states": ShapeRange((1, 1, 8), (2, 1, 8), (4, 1, 8)),
        "attention_mask": ShapeRange((1, 1, 2), (2, 1, 33), (4, 1, 65)),
        "latent_cache": ShapeRange((1, 1, 12), (2, 32, 12), (4, 64, 12)),
    }
    assert Profile.from_dict(json.loads(json.dumps(prefill.as_dict()))) == prefill


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny config's graphs as `k2trt export --dtype bfloat16` writes them (graphs only, ~1 s)."""
    from k2trt.export.exporter import export

    out = tmp_path_factory.mktemp("export") / "onnx"
    export(TINY, out, "bfloat16", 1, log=lambda *a, **k: None)
    return out


def test_profiles_of_an_exported_block_graph(exported):
    """The pool read in place: no P (no gathered cache, no mask) — the page tables up to --max-seq in pages, the
    pool up to --max-batch sequences at --max-seq (the runtime's default pool); both forms alike."""
    graphs = export_manifest.read_manifest(exported)["graphs"]
    for key in ("trt/moe_block", "trt/moe_block.prefill"):
        prefill, decode = graph_profiles(ProfileSpec(), graphs[key])
        assert set(prefill.shapes) == {"hidden_states", "rope_cos", "rope_sin", "kv_pool", "page_table",
                                       "ctx_lens", "n_new"}
        assert prefill.shapes["page_table"] == ShapeRange((1, 1), (1, 1024 // 64), (8, 4096 // 64))
        assert decode.shapes["kv_pool"] == ShapeRange((64, TINY.latent_dim), (1024, TINY.latent_dim),
                                                      (8 * 4096, TINY.latent_dim))
        assert decode.shapes["ctx_lens"].max == (8,)
        assert decode.shapes["rope_cos"].max == (8, 1, TINY.qk_rope_head_dim // 2)
        assert ProfileSpec().pool_pages * 64 == 8 * 4096


def test_profiles_of_the_expert_parallel_parts(tmp_path):
    """The experts engine's rows R: in decode up to every rank's batch on one rank (E·B·k), in prefill one rank's
    B·T·k per call; the front and the combine keep B and T (the combine's pairs B·T·k)."""
    from k2trt.export.exporter import export

    m = export(TINY, tmp_path / "onnx", "bfloat16", 1, log=lambda *a, **k: None, expert_parallel=4)
    spec = ProfileSpec()
    prefill, decode = graph_profiles(spec, m["graphs"]["trt/moe_experts"])
    assert prefill.shapes["expert_rows"] == ShapeRange((1, TINY.hidden_size), (512 * 8, TINY.hidden_size),
                                                       (8 * 2048 * 8, TINY.hidden_size))
    assert decode.shapes["expert_ids"] == ShapeRange((1,), (8,), (4 * 8 * 8,))
    combine = graph_profiles(spec, m["graphs"]["trt/moe_combine"])[0]
    assert combine.shapes["pair_out"].max == (8 * 2048 * 8, TINY.hidden_size)
    for key in ("trt/moe_front", "trt/moe_front.prefill"):  # the front attends: both forms, the pool in place
        assert graph_profiles(spec, m["graphs"][key])[1].shapes["kv_pool"].max == (8 * 4096, TINY.latent_dim)


def test_an_engines_weights_are_prepared_as_its_graph_says(exported):
    """The engine manifest carries each graph's weight preparation, which TrtBackend's upload reads: a block's
    kv_b_proj goes to its engine dequantized, every weight in the dtype and shape the engine declares (no GPU
    needed: the upload's device is a parameter)."""
    from k2trt.runtime.backends.tensorrt import upload_weights
    from k2trt.tiny.synthetic import RandomWeights

    graph = export_manifest.read_manifest(exported)["graphs"]["trt/dense_block"]
    entry = EM.engine_entry("dense_block", graph, graph_profiles(TOY_SPEC, graph), "dense_block.engine", "0" * 64, {})
    assert entry["prep"] == graph["prep"] and entry["prep"]
    up = upload_weights(entry, RandomWeights(TINY).block_weights(0), torch.bfloat16, "cpu")
    assert sorted(up) == sorted(entry["weights"])
    declared = {i["name"]: i for i in entry["inputs"]}
    assert all(list(t.shape) == declared[n]["shape"] for n, t in up.items())
    assert up["self_attn.kv_b_proj.weight.dequant"].dtype == torch.bfloat16


def test_defaults_and_flags():
    p = argparse.ArgumentParser()
    add_profile_arguments(p)
    spec = spec_from_args(p.parse_args(["--max-batch", "2", "--max-seq", "128", "--max-prefill", "64",
                                        "--opt-batch", "1", "--opt-prefill", "16", "--opt-seq", "100"]))
    assert spec == ProfileSpec(2, 128, 64, 1, 16, 100)
    assert spec_from_args(p.parse_args([])) == ProfileSpec()  # no flags: the spec's own defaults


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_seq=1024, max_prefill=2048, opt_prefill=512, opt_seq=512), "--max-prefill 2048 exceeds --max-seq 1024"),
    (dict(max_batch=4, opt_batch=8), "--opt-batch 8 exceeds --max-batch 4"),
    (dict(max_prefill=256, opt_prefill=512), "--opt-prefill 512 exceeds --max-prefill 256"),
    (dict(opt_seq=8192), "--opt-seq 8192 exceeds --max-seq 4096"),
    (dict(max_batch=0), "--max-batch must be a positive integer"),
])
def test_profile_validation(kwargs, message):
    with pytest.raises(ProfileError, match=message):
        ProfileSpec(**kwargs)


def test_dim_expressions():
    v = {"B": 2, "T": 3, "P": 10}
    assert [eval_dim(d, v) for d in (7, "B", "P+T", "P + T - 1", "2*T")] == [7, 2, 13, 12, 6]
    with pytest.raises(ProfileError, match="names 'Q'"):
        eval_dim("Q+T", v)
    with pytest.raises(ProfileError, match="only"):
        eval_dim("P/T", v)
    with pytest.raises(ProfileError, match="cannot parse"):
        eval_dim("P+", v)


def test_profile_choice_and_call_limits():
    assert (profile_index(1), profile_index(2)) == (DECODE, PREFILL)
    check_call_shape(TOY_SPEC, 4, 16, 64)
    with pytest.raises(K2Error, match="batch 5"):
        check_call_shape(TOY_SPEC, 5, 1, 8)
    with pytest.raises(K2Error, match="--max-prefill 16"):
        check_call_shape(TOY_SPEC, 1, 17, 64)
    with pytest.raises(K2Error, match="--max-seq 64"):
        check_call_shape(TOY_SPEC, 1, 1, 65)


# ---- engine manifest ---------------------------------------------------------------------------------------

ENV = {"tensorrt_version": "11.4.0.1", "gpu_name": "NVIDIA H200", "compute_capability": "9.0"}


def _export_manifest() -> dict:
    graphs = {f"trt/{k}": {"file": f"trt/{k}.onnx", "sha256": f"{i}" * 64, **TOY_GRAPH}
              for i, k in enumerate(("embedding", "head"))}
    return {"config_fingerprint": TINY.fingerprint(), "config": TINY.to_hf_dict(), "act_dtype": "bfloat16",
            "activation_quant": 1, "layers": {"embedding": [], "head": []}, "graphs": graphs}


def _engine_dir(tmp_path, export: dict):
    engines = {}
    for kind in ("embedding", "head"):
        path = tmp_path / f"{kind}.engine"
        path.write_bytes(f"serialized {kind}".encode())
        graph = export["graphs"][f"trt/{kind}"]
        engines[kind] = EM.engine_entry(kind, graph, graph_profiles(TOY_SPEC, graph), path.name,
                                        EM.sha256_file(path), {"Fp8BlockLinear": "aot", "MoeAlign": "aot"})
    manifest = EM.make_engine_manifest(export, TOY_SPEC, ENV, engines)
    EM.write_engine_manifest(tmp_path, manifest)
    return manifest


def test_engine_manifest_round_trip(tmp_path):
    export = _export_manifest()
    written = _engine_dir(tmp_path, export)
    loaded = EM.load_engine_manifest(tmp_path, export, env=dict(ENV))
    assert loaded == json.loads(json.dumps(written))
    assert loaded["gpu"] == {"name": "NVIDIA H200", "compute_capability": "9.0"}
    assert loaded["engines"]["head"]["source_sha256"] == "1" * 64
    assert EM.profile_spec_of(loaded) == TOY_SPEC
    assert [Profile.from_dict(p) for p in loaded["engines"]["embedding"]["profiles"]] == \
        graph_profiles(TOY_SPEC, TOY_GRAPH)


@pytest.mark.parametrize("change, message", [
    (lambda env, exp: env.update(tensorrt_version="10.13.0"), "built with TensorRT 11.4.0.1, this is TensorRT 10.13.0"),
    (lambda env, exp: env.update(compute_capability="10.0", gpu_name="NVIDIA B200"),
     r"compute capability 9.0 \(NVIDIA H200\), this GPU is 10.0 \(NVIDIA B200\)"),
    (lambda env, exp: exp["graphs"]["trt/head"].update(sha256="f" * 64), "head.engine was built from another"),
    (lambda env, exp: exp.update(config_fingerprint="0" * 16), "built for config"),
    (lambda env, exp: exp.update(act_dtype="float32"), "engines compute in bfloat16"),
])
def test_engine_manifest_mismatches(tmp_path, change, message):
    export = _export_manifest()
    _engine_dir(tmp_path, export)
    env = dict(ENV)
    change(env, export)
    with pytest.raises(EM.EngineMismatch, match=message):
        EM.load_engine_manifest(tmp_path, export, env=env)


def test_engine_files_and_format_checked(tmp_path):
    export = _export_manifest()
    _engine_dir(tmp_path, export)
    (tmp_path / "head.engine").write_bytes(b"truncated")
    with pytest.raises(EM.EngineMismatch, match="does not match its manifest"):
        EM.load_engine_manifest(tmp_path, env=ENV)
    (tmp_path / "head.engine").unlink()
    with pytest.raises(K2Error, match="head.engine is missing"):
        EM.load_engine_manifest(tmp_path, env=ENV)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "format": "k2trt-engines/0"}))
    with pytest.raises(K2Error, match="rebuild with this version"):
        EM.load_engine_manifest(tmp_path, env=ENV)
    with pytest.raises(K2Error, match="no manifest.json"):
        EM.load_engine_manifest(tmp_path / "nowhere", env=ENV)


def test_ptx_newer_than_the_driver_is_refused_at_load(tmp_path):
    export = _export_manifest()
    _engine_dir(tmp_path, export)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "ptx_version": 90}))
    EM.load_engine_manifest(tmp_path, env={**ENV, "cuda_driver": "13.0"})
    with pytest.raises(EM.EngineMismatch, match=r"PTX 9.0, this driver \(CUDA 12.9\) loads up to 8.8"):
        EM.load_engine_manifest(tmp_path, env={**ENV, "cuda_driver": "12.9"})


# ---- the PTX an AOT kernel may carry ----------------------------------------------------------------------------

def test_ptx_version_follows_the_driver_and_ptxas():
    from k2trt.runtime.tensorrt import environment as E

    # PTX ISA release notes: CUDA 12.0-12.5 -> 8.0-8.5, 12.6 none new, 12.7-12.9 -> 8.6-8.8, 13.0 -> 9.0
    assert [E.max_ptx_for_cuda(12, m) for m in (0, 4, 5, 6, 7, 8, 9)] == [80, 84, 85, 85, 86, 87, 88]
    assert (E.max_ptx_for_cuda(13, 0), E.max_ptx_for_cuda(13, 2)) == (90, 92)
    assert E.ptx_version_for((13, 0), 94) == 90  # Triton 3.9's ptxas emits 9.4; a CUDA 13.0 driver loads 9.0
    assert E.ptx_version_for((12, 9), 94) == 88
    assert E.ptx_version_for((13, 4), 90) == 90  # never newer than ptxas checks
    assert E.ptx_version_for(None, None) is None


def test_ptx_is_capped_by_the_tensorrt_wheels_cuda_and_versions_are_checked():
    from k2trt.runtime.tensorrt import environment as E

    # a cu12 TensorRT on a CUDA 13 driver: PTX 8.8 (the newest CUDA 12.x's), not the driver's 9.0
    assert E.ptx_version_for((13, 0), 94, wheel_cuda=12) == 88
    assert E.ptx_version_for((13, 0), 94, wheel_cuda=13) == 90
    assert E.ptx_version_for((12, 4), 94, wheel_cuda=12) == 84
    assert E.check_tensorrt("10.16.1", 12, (13, 0)) is None and E.check_tensorrt("11.4.0.106", 13, (13, 1)) is None
    assert "outside what k2trt supports (>= 10.15, < 12)" in E.check_tensorrt("10.14.1", 12, (12, 9))
    assert "outside" in E.check_tensorrt("12.0.0", 13, (13, 0))
    assert "built for CUDA 13 (tensorrt-cu13) but the driver is CUDA 12.8" in E.check_tensorrt("11.1.0", 13, (12, 8))


def test_tensorrt_wheel_cuda_from_the_distribution_name(monkeypatch):
    from importlib import metadata

    from k2trt.runtime.tensorrt import environment as E

    def dists(*names):
        return lambda: [argparse.Namespace(metadata={"Name": n}) for n in names]

    monkeypatch.setattr(metadata, "distributions", dists("numpy", "tensorrt_cu13_bindings", "tensorrt"))
    assert E.tensorrt_wheel_cuda() == 13
    monkeypatch.setattr(metadata, "distributions", dists("tensorrt-cu12"))
    assert E.tensorrt_wheel_cuda() == 12
    monkeypatch.setattr(metadata, "distributions", dists("tensorrt", "tensorrt-lean"))
    assert E.tensorrt_wheel_cuda() is None


def test_timing_caches_are_per_activation_dtype_and_mode(tmp_path):
    from pathlib import Path

    assert B.timing_cache_file(Path("c/tc.bin"), "bfloat16", 1) == Path("c/tc.bfloat16-w8a8.bin")
    assert B.timing_cache_file(Path("tc"), "bfloat16", 0) == Path("tc.bfloat16-w8a16")
    assert B.timing_cache_file(Path("tc"), "float32", 0) != B.timing_cache_file(Path("tc"), "float16", 0)


# ---- plugins ↔ contracts ↔ exported nodes ---------------------------------------------------------------------

def test_every_tensorrt_node_is_a_plugin_with_both_implementations():
    specs = plugins.plugin_specs()
    assert set(specs) == {c.op_type for c in contracts.TENSORRT}
    for spec in specs.values():
        assert spec.version == plugins.QDP_PLUGIN_VERSION  # what tensorrt.plugin registers every plugin as
        assert not set(spec.attribute_names) & set(plugins.PARSER_ATTRIBUTES)  # the parser would swallow them
    assert specs["Fp8BlockLinear"].tactics == (1, 2, 3) and specs["MoeGateUp"].tactics == (1, 2, 3)
    assert specs["MoeAlign"].tactics == () and specs["MoeCombine"].tactics == ()
    assert "MoeFp8" not in specs  # expanded by export/split_moe.py: no plugin, so no Python-only node


def test_plugin_functions_have_the_signatures_tensorrt_checks():
    for op, spec in plugins.plugin_specs().items():
        desc, impl, autotune, aot = plugins.PLUGIN_FUNCTIONS[op]
        expected = plugins.expected_signatures(spec)
        got = {"register": desc, "impl": impl, "autotune": autotune, "aot_impl": aot}
        for role, fn in got.items():
            assert list(inspect.signature(fn).parameters) == expected[role], (op, role)


FP8_MOE_NODES = {c.op_type for c in (contracts.FP8_BLOCK_LINEAR, *contracts.MOE_STAGES)}
INT4_MOE_NODES = {c.op_type for c in contracts.MOE_INT4_STAGES}  # attention and the shared expert are bf16 MatMuls
DECODE_NODES = {"MlaDecodeSplit", "MlaDecodeMerge"}  # the paged attention, absorbed
PREFILL_NODES = {"MlaDecompress", "MlaAttend"}  # and decompressed


# presets by name: an INT4 config's quantization is parsed by compressed-tensors, an import of seconds that
# collecting the suite should not pay
@pytest.mark.parametrize("preset, kind, form, act, aq, nodes", [
    ("tiny", "moe_block", "decode", "bfloat16", 1, FP8_MOE_NODES | DECODE_NODES),
    ("tiny", "moe_block", "prefill", "float16", 0, FP8_MOE_NODES | PREFILL_NODES),
    ("tiny", "dense_block", "decode", "float32", 1, {"Fp8BlockLinear"} | DECODE_NODES),
    ("tiny", "dense_block", "prefill", "bfloat16", 1, {"Fp8BlockLinear"} | PREFILL_NODES),
    ("tiny-int4", "moe_block", "decode", "bfloat16", 1, INT4_MOE_NODES | DECODE_NODES),
    ("tiny-int4", "moe_block", "prefill", "float32", 0, INT4_MOE_NODES | PREFILL_NODES)])
def test_exported_nodes_match_the_plugins(preset, kind, form, act, aq, nodes):
    """Each node of a TensorRT-bound graph: the plugin's attributes, dtypes (as register derives them) and output
    shapes (its rule against the exporter's annotation, at two values of B and T; the decode's splits S as the
    rule computes them)."""
    from k2trt.export.trt_form import tensorrt_graph

    cfg = K2Config.preset(preset)
    model = tensorrt_graph(cfg, kind, act, aq, form=form)
    types = value_types(model)
    specs = plugins.plugin_specs()
    custom = [n for n in model.graph.node if n.domain == contracts.NAMESPACE]
    assert {n.op_type for n in custom} == nodes
    for node in custom:
        spec = specs[node.op_type]
        attrs = {a.name: a for a in node.attribute}
        assert attrs["plugin_namespace"].s.decode() == spec.namespace
        assert attrs["plugin_version"].s.decode() == spec.version
        assert set(attrs) - set(plugins.PARSER_ATTRIBUTES) == set(spec.attribute_names)
        values = {a: onnx.helper.get_attribute_value(attrs[a]) for a in spec.attribute_names}
        dtypes = [BY_ONNX[types[v].elem_type].name for v in node.input]
        assert plugins.check_input_dtypes(node.op_type, dtypes, values) == (None if node.op_type == "MoeAlign" else act)
        assert [BY_ONNX[types[v].elem_type].name for v in node.output] == \
            plugins.io_dtypes(node.op_type, act, aq)[len(node.input):]
        if any(isinstance(d, str) and d.startswith("unk") for v in node.input for d in dims(types[v])):
            continue  # shape inference lost a dim (TopK's k is an input): the node cases check those plugins
        for b, t, pages in ((1, 1, 1), (2, 3, 40)):
            named = {"B": b, "T": t, "pages": pages, "rows": 4096,
                     "S": plugins.decode_splits(b, t, cfg.num_attention_heads, pages, 64)}
            concrete = lambda shape: [eval_dim(d, named) for d in shape]  # noqa: E731
            rule = plugins.output_shapes(node.op_type, [concrete(dims(types[v])) for v in node.input], values)
            assert rule == [concrete(dims(types[v])) for v in node.output], node.name


def test_aot_attribute_is_written_on_every_plugin_node(tmp_path):
    from k2trt.export.split_moe import split_moe

    path = tmp_path / "moe.onnx"
    model = split_moe(build_block_graph(TINY, "moe_block", "bfloat16"))
    model.graph.node[[n.domain for n in model.graph.node].index(contracts.NAMESPACE)].attribute.append(
        onnx.helper.make_attribute("aot", 0))  # a stale attribute is replaced, not duplicated
    onnx.save_model(model, str(path))
    for aot in (True, False):
        data, used = B.with_aot_attribute(path, aot)
        for node in onnx.load_from_string(data).graph.node:
            values = [a.i for a in node.attribute if a.name == "aot"]
            assert values == ([int(aot)] if node.domain == contracts.NAMESPACE else []), node.name
        assert used == {op: "aot" if aot else "jit" for op in sorted(FP8_MOE_NODES)}


def test_mla_stages_run_jit_where_they_have_no_aot_form(tmp_path):
    """In a float32 engine the paged attention's plugins run JIT (no tile fits an AOT launch's 48 KiB:
    runtime/aot/mla.AOT_ACTIVATIONS); every other plugin, and every plugin in bfloat16, stays AOT."""
    for act, mla in (("float32", "jit"), ("bfloat16", "aot")):
        for form, stages in (("decode", DECODE_NODES), ("prefill", PREFILL_NODES)):
            path = tmp_path / f"{act}-{form}.onnx"
            onnx.save_model(_trt_graph("moe_block", act, 1, form), str(path))
            data, used = B.with_aot_attribute(path, True)
            assert used == {op: mla if op in stages else "aot" for op in sorted(FP8_MOE_NODES | stages)}
            for node in _plugin_nodes(onnx.load_from_string(data)):
                assert [a.i for a in node.attribute if a.name == "aot"] == [int(used[node.op_type] == "aot")]


def test_cuda_array_interface_for_types_tensorrt_refuses():
    iface = plugins.cuda_array_interface(1234, (2, 3), (3, 1), "bfloat16")
    assert iface == {"shape": (2, 3), "typestr": "<u2", "data": (1234, False), "version": 3, "strides": (6, 2)}
    assert plugins.cuda_array_interface(8, (4,), None, "float8_e4m3fn")["typestr"] == "|u1"
    import numpy as np

    for port in (p for c in contracts.CONTRACTS.values() for p in c.inputs + c.outputs):
        for dtype in port.dtypes:  # every type a plugin sees travels with its own item size
            assert np.dtype(plugins.interface_typestr(dtype)).itemsize == getattr(torch, dtype).itemsize


def test_attributes_arrive_as_arrays_and_are_read_as_values():
    import numpy as np

    assert plugins.attribute(np.array([1], dtype=np.int32)) == 1 and isinstance(plugins.attribute(np.array([7])), int)
    assert plugins.attribute("s") == "s"
    with pytest.raises(ValueError, match="single-value"):
        plugins.attribute(np.array([1, 2], dtype=np.int32))


# ---- registration and parsing, against the stand-in for TensorRT ---------------------------------------------

@pytest.fixture()
def standin(monkeypatch):
    """tensorrt and tensorrt.plugin replaced by the stand-in (tests/trt_standin.py) for register_plugins."""
    return _install(monkeypatch, S.TensorRTPlugin())


def _install(monkeypatch, trtp):
    from k2trt.runtime.tensorrt import environment

    trt = argparse.Namespace(DataType=S.DataType, plugin=trtp, __version__=".".join(map(str, trtp.version)) + ".0",
                             # a module in sys.modules has a spec: importlib.util.find_spec (torch._dynamo's import
                             # of compressed-tensors' dependencies) raises on one without
                             __spec__=importlib.machinery.ModuleSpec("tensorrt", None))
    monkeypatch.setattr(environment, "import_tensorrt_plugin", lambda: (trt, trtp))
    monkeypatch.setattr(plugins, "_REGISTERED", set())
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    return trtp


def _trt_graph(kind="moe_block", act="bfloat16", aq=1, form="decode") -> onnx.ModelProto:
    from k2trt.export.trt_form import tensorrt_graph

    return tensorrt_graph(TINY, kind, act, aq, form=form)


def _plugin_nodes(model):
    return [n for n in model.graph.node if n.domain == contracts.NAMESPACE]


def test_register_plugins_passes_tensorrts_validation(standin):
    assert plugins.register_plugins() == {op: "jit+aot" for op in plugins.plugin_specs()}
    for op, spec in plugins.plugin_specs().items():
        pdef = standin.registry[spec.plugin_id]
        assert pdef.input_tensor_names == spec.input_names and pdef.num_outputs == len(spec.output_names)
        assert list(pdef.input_attrs) == spec.attribute_names
        assert pdef.impl_func and pdef.aot_impl_func and pdef.autotune_func
        assert pdef.expects_tactic == bool(spec.tactics)
        # the creator declares INT32 and FLOAT32 fields for our attributes: what the ONNX parser hands over for INT
        # and FLOAT ones (onnx-tensorrt loadFields; the MLA stages' softmax_scale is a FLOAT)
        assert set(standin.field_names(spec.plugin_id).values()) <= {"INT32", "FLOAT32"}


def test_standin_rejects_todays_graphs_and_registration(standin, monkeypatch, tmp_path):
    """What failed before this fix, as TensorRT's source says it fails: (1) the exported graph parsed as it was
    (no `aot` attribute, no PREFER_* flag) — the creator refuses a plugin with both implementations; (2) attributes
    annotated `int` — the parser's 1-element array through int() is a TypeError on NumPy >= 2.4."""
    plugins.register_plugins()
    exported = _trt_graph()
    flags = B.network_flags(argparse.Namespace(
        __version__="10.13.0", NetworkDefinitionCreationFlag=S.NetworkDefinitionCreationFlag))
    with pytest.raises(S.TensorRTError, match="has both AOT and JIT implementations"):
        S.parse_plugin_node(standin, _plugin_nodes(exported)[0], flags)

    path = tmp_path / "m.onnx"
    onnx.save_model(exported, str(path))
    fixed = onnx.load_from_string(B.with_aot_attribute(path, True)[0])
    parsed = [S.parse_plugin_node(standin, n, flags) for n in _plugin_nodes(fixed)]
    assert {p.kind for p in parsed} == {"aot"}

    before = _install(monkeypatch, S.TensorRTPlugin())
    monkeypatch.setitem(plugins.ATTRIBUTE_ANNOTATIONS, "int", int)  # the annotation of today's plugins
    plugins.register_plugins()
    with pytest.raises(S.TensorRTError, match="TypeError"):
        S.parse_plugin_node(before, _plugin_nodes(fixed)[0], flags)


def test_jit_engines_reload_their_attributes(standin, tmp_path):
    """A JIT plugin's attributes are serialized into the engine and handed to create_plugin again on load."""
    plugins.register_plugins()
    path = tmp_path / "m.onnx"
    onnx.save_model(_trt_graph(), str(path))
    for node in _plugin_nodes(onnx.load_from_string(B.with_aot_attribute(path, False)[0])):
        plugin = S.parse_plugin_node(standin, node)
        assert plugin.kind == "jit"
        fields = plugin.fields_to_serialize()
        loaded = standin.create_plugin(plugin.pdef.plugin_id, fields, None)
        assert [plugins.attribute(a) for a in loaded.impl_arguments()] == [plugins.attribute(a) for a in plugin.impl_arguments()]


def test_standin_follows_the_parser_and_creator_rules(standin):
    plugins.register_plugins()
    node = _plugin_nodes(_trt_graph())[0]
    both = (1 << S.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS) | \
        (1 << S.NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS)
    with pytest.raises(S.TensorRTError, match="cannot be specified at the same time"):
        S.parse_plugin_node(standin, node, both)
    assert S.parse_plugin_node(standin, node, 1 << S.NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS).kind \
        == "jit"
    node.attribute.append(onnx.helper.make_attribute("aot", 1))  # the node's attribute overrides the flag
    assert S.parse_plugin_node(standin, node, 1 << S.NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS).kind \
        == "aot"
    other = onnx.helper.make_node("Fp8BlockLinear", ["x"], ["y"], name="n", domain="k2trt",
                                  plugin_namespace="k2trt", plugin_version="2")
    with pytest.raises(S.TensorRTError, match="Plugin not found"):
        S.parse_plugin_node(standin, other)
    # type strings as _str_to_data_type reads them
    assert S.str_to_data_type("FP32") is S.DataType.FLOAT and S.str_to_data_type("BF16") is S.DataType.BF16
    with pytest.raises(AttributeError):
        S.str_to_data_type("bfloat16")
    assert [plugins.trt_type_name(d) for d in ("float32", "float16", "bfloat16", "float8_e4m3fn", "int32")] == \
        ["FLOAT", "HALF", "BF16", "FP8", "INT32"]
    combos = S.AutoTuneCombination("FP32|FP16, FP32|FP16, INT32", "LINEAR", [1]).combinations()
    assert [c[0] for c in combos] == [(S.DataType.FLOAT,) * 2 + (S.DataType.INT32,),
                                      (S.DataType.HALF,) * 2 + (S.DataType.INT32,)]


def test_standin_follows_tensorrt_where_it_was_lenient(standin):
    """Rules the stand-in once modelled leniently, each as TensorRT's source states it (cited in trt_standin.py)."""
    import numpy as np
    import numpy.typing as npt

    plugins.register_plugins()
    node = _plugin_nodes(_trt_graph())[0]
    # plugin_namespace defaults to "", not the node's domain; later parsers retry with the domain after a miss
    bare = onnx.helper.make_node(node.op_type, list(node.input), list(node.output), name="bare", domain=node.domain,
                                 plugin_version="1", aot=1, activation_quant=1)
    with pytest.raises(S.TensorRTError, match="Plugin not found"):
        S.parse_plugin_node(standin, bare)
    assert S.parse_plugin_node(standin, bare, domain_fallback=True).kind == "aot"

    trtp = S.TensorRTPlugin()
    # *args, **kwargs and positional-only parameters are refused at registration
    for fn in ("def f(x, *rest): return x", "def f(x, **kw): return x", "def f(x, /, a): return x"):
        scope = {}
        exec(fn, scope)
        scope["f"].__annotations__ = {"x": S.TensorDesc, "return": S.TensorDesc}
        with pytest.raises(ValueError, match="positional-or-keyword or keyword-only"):
            trtp.register("toy::args")(scope["f"])
    # from_shape_expr takes a tuple (or ShapeExprs), not a list
    with pytest.raises(TypeError, match="tuple or ShapeExprs"):
        S.from_shape_expr([S.dim(2)], S.DataType.FLOAT)
    # one AutoTuneCombination entry mixing '|' and '*'
    with pytest.raises(ValueError, match="contains both"):
        S.AutoTuneCombination("FP32|FP16*BF16, FP32").combinations()
    assert len(S.AutoTuneCombination("FP32*FP16, FP32|FP16").combinations()) == 4  # across entries: allowed

    # a plain int as an extra launch argument becomes a SymIntExpr, which get_launch_params refuses
    def desc(x, a):
        return trtp.from_shape_expr(tuple(x.shape_expr), x.dtype)

    desc.__annotations__ = {"x": S.TensorDesc, "a": npt.NDArray[np.int32], "return": S.TensorDesc}
    trtp.register("toy::op")(desc)

    def aot(x, a, outputs, tactic):
        extra = S.SymIntExprs(2)
        extra[0] = S.SymInt32(x.shape_expr[0])
        extra[1] = 7
        return "k", "ptx", S.KernelLaunchParams(), extra

    aot.__annotations__ = {"return": tuple[str, str, S.KernelLaunchParams, S.SymIntExprs]}
    trtp.aot_impl("toy::op")(aot)
    plugin = trtp.create_plugin("toy::op", {"a": np.array([1], np.int32)}, S.QuickPluginCreationRequest.STRICT_AOT)
    plugin.output_shapes([S.TensorDesc([S.dim(4, True)], S.DataType.FLOAT)])
    with pytest.raises(TypeError, match="must be a 'tensorrt.plugin.SymInt32'"):
        plugin.launch(0)

    # a STRING attribute arrives with its NUL terminator; plugins.attribute drops it
    text = onnx.helper.make_attribute("name", "silu")
    field = S._field(text)
    assert field.tobytes() == b"silu\0"
    assert plugins.attribute(field.tobytes().decode("utf-8")) == "silu"


def test_standin_flags_and_builder_by_tensorrt_version(monkeypatch):
    """TensorRT 11 moved the network-creation flags (NvInfer.h: STRONGLY_TYPED 0, deprecated; PREFER_JIT 1;
    PREFER_AOT 2); before 10.15 SymIntExpr._exprBuilder outlived its shape call, which MoeAlign's [E + 1] output
    meets the next time TensorRT asks for output types — why pyproject asks for TensorRT >= 10.15."""
    trtp = _install(monkeypatch, S.TensorRTPlugin("11.1"))
    plugins.register_plugins()
    node = _plugin_nodes(_trt_graph())[0]
    flags11 = S.NetworkDefinitionCreationFlag11
    assert S.parse_plugin_node(trtp, node, 1 << flags11.PREFER_JIT_PYTHON_PLUGINS).kind == "jit"
    assert S.parse_plugin_node(trtp, node, 1 << flags11.PREFER_AOT_PYTHON_PLUGINS).kind == "aot"
    # what a 10.x flag number means in 11: bit 2 (10.x PREFER_JIT) is 11's PREFER_AOT
    assert S.parse_plugin_node(trtp, node, 1 << S.NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS).kind \
        == "aot"
    assert B.network_flags(argparse.Namespace(__version__="11.1.0", NetworkDefinitionCreationFlag=flags11)) == 0

    align = next(n for n in _plugin_nodes(_trt_graph()) if n.op_type == "MoeAlign")
    align.attribute.append(onnx.helper.make_attribute("aot", 1))
    ids = [S.TensorDesc([S.dim(2, True), S.dim(3, True), S.dim(8)], S.DataType.INT32)]
    for version, stale in (("10.16", False), ("10.14", True)):
        trtp = _install(monkeypatch, S.TensorRTPlugin(version))
        plugins.register_plugins()
        plugin = S.parse_plugin_node(trtp, align)
        plugin.output_types([S.DataType.INT32], [3])
        plugin.output_shapes(ids)
        if stale:
            with pytest.raises(RuntimeError, match="finished shape call"):
                plugin.output_types([S.DataType.INT32], [3])
        else:
            assert plugin.output_types([S.DataType.INT32], [3]) == [S.DataType.INT32, S.DataType.INT32]
    S._BUILDER.update(active=False, stale=False)


def test_tensorrt_without_aot_registers_jit_only_and_aot_builds_refuse(monkeypatch):
    _install(monkeypatch, S.JitOnlyTensorRTPlugin())
    modes = plugins.register_plugins()
    assert set(modes.values()) == {"jit"}
    B.check_plugin_modes(modes, aot=False, version="10.8.0")
    with pytest.raises(K2Error, match=r"AOT plugins need TensorRT >= 10.9, this is 10.8.0; build with --plugins jit"):
        B.check_plugin_modes(modes, aot=True, version="10.8.0")


# ---- every AOT kernel, launched as TensorRT launches it -------------------------------------------------------

def _descs_of(case, model):
    """The network's input descriptors of a one-node graph: constant dims where static, dynamic where named."""
    from k2trt.dtypes import name_of

    inputs = []
    for vi in model.graph.input:
        t = case.inputs[vi.name]
        dims = [S.dim(int(t.shape[i]), bool(d.dim_param)) for i, d in enumerate(vi.type.tensor_type.shape.dim)]
        inputs.append(S.TensorDesc(dims, getattr(S.DataType, plugins.trt_type_name(name_of(t.dtype)))))
    return inputs


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.full(t.shape, float("nan")).to(t.dtype)
    return torch.full(t.shape, -7, dtype=t.dtype)


def _real_compiles(monkeypatch, aot_compiled) -> dict:
    """aot.compile_launch answered from the session's real sm_90 compiles (conftest.aot_compiled): the launch
    shrunk as its configuration compiled, with that compile's shared memory and launch width; -> launches by name."""
    from k2trt.runtime.aot import ptx as aot
    from k2trt.runtime.aot import sweep as AC

    by_key = AC.results_by_key(aot_compiled[0])
    compiled = {}

    def real_compile(launch, target=None):
        result = by_key.get(launch.config_key())
        assert result is not None, f"{launch.label}: a configuration the compile run did not cover"
        chosen = AC.compiled_like(launch, result)
        name = f"{aot.ENTRY_PREFIX}{chosen.label}_{len(compiled)}"
        compiled[name] = chosen
        return chosen, aot.AotKernel(name, f".version 8.8\n.visible .entry {name}(", result["threads"],
                                     result["shared"])

    monkeypatch.setattr(aot, "compile_launch", real_compile)
    return compiled


def _aot_plugin(standin, model, tmp_path, name):
    path = tmp_path / f"{name}.onnx"
    onnx.save_model(model, str(path))
    (node,) = onnx.load_from_string(B.with_aot_attribute(path, True)[0]).graph.node
    plugin = S.parse_plugin_node(standin, node)
    assert plugin.kind == "aot"
    return plugin


def _emulate(standin, compiled, tmp_path, case, run: bool = True) -> dict[str, list[str]]:
    """Parse the case's one-node graph, create its AOT plugin, ask for each tactic's launch (compiled for real:
    _real_compiles), and — with `run` — launch it under Triton's interpreter with TensorRT's argument order
    (inputs, extra scalars, outputs) and grid; -> tactic -> mismatches against the reference."""
    from k2trt.runtime.aot import ptx as aot
    from k2trt.runtime.tensorrt.plugin_cases import mismatches, one_node_model

    model = one_node_model(case)
    plugin = _aot_plugin(standin, model, tmp_path, case.op_type)
    inputs = _descs_of(case, model)
    out_types = plugin.output_types([d.dtype for d in inputs], [d.ndim for d in inputs])
    shapes = plugin.output_shapes(inputs)
    names = [p.name for p in contracts.CONTRACTS[case.op_type].outputs]
    assert [[e.value for e in s] for s in shapes] == [list(case.expected[n].shape) for n in names]
    types = tuple(d.dtype for d in inputs) + tuple(out_types)
    results = {}
    for tactic in plugin.tactics_for(types):
        params = plugin.launch(tactic)
        launch = compiled[params["name"]]
        assert 0 <= params["shared_mem"] <= aot.AOT_SHARED_LIMIT and params["block_x"] == launch.num_warps * 32
        if not run:
            results[tactic] = []
            continue
        outs = {n: _poisoned(case.expected[n]) for n in names}
        args = [case.inputs[vi.name].contiguous() for vi in model.graph.input] + params["extra"] + list(outs.values())
        grid = (params["grid_x"], params["grid_y"], params["grid_z"])
        launch.kernel[grid](*args, **launch.constexprs(), num_warps=launch.num_warps, num_stages=launch.num_stages)
        results[tactic] = mismatches(case, outs)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("act, aq", [(a, q) for a in contracts.ACTIVATION_DTYPES for q in (1, 0)])
def test_every_aot_kernel_matches_its_reference(standin, monkeypatch, tmp_path, aot_compiled, act, aq):
    """k2trt doctor's one-node cases, every dtype and mode, every tactic, each as the plan really compiled for
    sm_90 (shrunk to fit its shared memory): the kernel TensorRT would launch writes every output (they start
    poisoned) and matches the torch reference (skewed routing with an empty expert)."""
    from k2trt.runtime.tensorrt.plugin_cases import node_cases

    from k2trt.runtime.aot.nodes import AOT_NODES
    from k2trt.runtime.aot.sweep import case_activation

    plugins.register_plugins()
    compiled = _real_compiles(monkeypatch, aot_compiled)
    jit = []
    for case in node_cases(act, aq):
        if not AOT_NODES[case.op_type].has_aot(case_activation(case)):
            jit.append(case.op_type)  # runs JIT in every engine: test_mla_plugin_bodies_match_their_references
            continue
        results = _emulate(standin, compiled, tmp_path, case)
        assert results and all(not m for m in results.values()), (case.label, results)
        assert len(results) == len(plugins.plugin_specs()[case.op_type].tactics or [0])
    assert jit == ([c.op_type for c in contracts.MLA_STAGES] if act == "float32" else [])


def _graph_on_standin(standin, compiled, tmp_path, model, sizes=None) -> int:
    """Every plugin node of a TensorRT-bound graph as TensorRT's builder drives it: parsed with aot=1, types and
    shapes inferred, every tactic's launch asked for (each a real sm_90 compile within 48 KiB); -> launches."""
    from k2trt.runtime.aot import ptx as aot
    from k2trt.runtime.aot.nodes import AOT_NODES

    sizes = sizes or {"B": 2, "T": 3, "pages": 5, "rows": 1024, "S": plugins.decode_splits(2, 3, 4, 5, 64)}
    types = value_types(model)
    asked = 0
    for i, node in enumerate(_plugin_nodes(model)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        act = plugins.check_input_dtypes(node.op_type, [BY_ONNX[types[v].elem_type].name for v in node.input], attrs)
        if not AOT_NODES[node.op_type].has_aot(act):
            continue  # JIT in every engine (the MLA stages in float32)
        typed = [onnx.helper.make_tensor_value_info(v, types[v].elem_type, dims(types[v])) for v in node.input]
        one = onnx.helper.make_model(onnx.helper.make_graph([node], "g", typed, []), opset_imports=[
            onnx.helper.make_opsetid("", 20), onnx.helper.make_opsetid(contracts.NAMESPACE, 1)])
        plugin = _aot_plugin(standin, one, tmp_path, f"node{i}")
        descs = []
        for v in node.input:  # named dims dynamic, dims shape inference lost taken as 6
            shape = [S.dim(d, False) if isinstance(d, int) else
                     S.dim(6 if d.startswith("unk") else eval_dim(d, sizes), True) for d in dims(types[v])]
            descs.append(S.TensorDesc(shape, getattr(S.DataType, plugins.trt_type_name(
                BY_ONNX[types[v].elem_type].name))))
        out_types = plugin.output_types([d.dtype for d in descs], [d.ndim for d in descs])
        plugin.output_shapes(descs)
        assert out_types == [getattr(S.DataType, plugins.trt_type_name(BY_ONNX[types[v].elem_type].name))
                             for v in node.output], node.name
        for tactic in plugin.tactics_for(tuple(d.dtype for d in descs) + tuple(out_types)):
            params = plugin.launch(tactic)
            assert params["name"] in compiled and params["shared_mem"] <= aot.AOT_SHARED_LIMIT, node.name
            asked += 1
    return asked


@pytest.mark.slow
@pytest.mark.parametrize("act, aq", [(a, q) for a in contracts.ACTIVATION_DTYPES for q in (1, 0)])
def test_doctor_block_engines_build_on_the_standin(standin, monkeypatch, tmp_path, aot_compiled, act, aq):
    """k2trt doctor step 4 (the tiny model's engines; doctor's own are float32 W8A16), every dtype and mode:
    every plugin node of the TensorRT-bound graphs through the stand-in with the real compiled launches."""
    plugins.register_plugins()
    compiled = _real_compiles(monkeypatch, aot_compiled)
    asked = sum(_graph_on_standin(standin, compiled, tmp_path, _trt_graph(kind, act, aq, form))
                for kind in ("dense_block", "moe_block") for form in ("decode", "prefill"))
    assert asked >= 2 * 3 + 4 + (0 if act == "float32" else 4)  # linears, GEMMs, align, combine; attention


@pytest.mark.slow
def test_expert_parallel_parts_build_on_the_standin(standin, monkeypatch, tmp_path, aot_compiled):
    """The MoE block's parts for EP 2 (bfloat16, both FP8 modes, FP8 and INT4 experts): every plugin node — the
    front's linears, the experts' align / gate+up / down over 192 experts and their top-1 combine, the combine's
    MoeCombine — parsed, typed and given every tactic's launch, each configuration really compiled."""
    from k2trt.export.trt_form import forms, tensorrt_graph

    plugins.register_plugins()
    compiled = _real_compiles(monkeypatch, aot_compiled)
    asked = 0
    sizes = {"B": 2, "T": 3, "R": 5, "pages": 5, "rows": 1024, "S": plugins.decode_splits(2, 3, 4, 5, 64)}
    for cfg in (TINY, K2Config.preset("tiny-int4")):
        for aq in (1, 0):
            for kind in ("moe_front", "moe_experts", "moe_combine"):
                for form in forms(kind):  # the front attends: its decode and prefill forms
                    model = tensorrt_graph(cfg, kind, "bfloat16", aq, experts=192, form=form)
                    asked += _graph_on_standin(standin, compiled, tmp_path, model, sizes)
    assert asked > 0


@pytest.mark.slow
def test_k2_size_expert_weights_and_their_fallback_on_the_standin(standin, monkeypatch, tmp_path, aot_compiled):
    """doctor's K2-size case — one MoeGateUp whose expert weights are 384 x 2048 x 7168, 5.6e9 elements, over 2^31 —
    and the fallback's (one range of 128 experts, 1.9e9) parse, infer their shapes and get every tactic's launch;
    whether TensorRT binds a plugin input that large is what only a GPU machine shows. The K2 MoE block in three
    expert ranges (export --expert-ranges 3) goes through the stand-in whole."""
    from k2trt.export.trt_form import tensorrt_graph
    from k2trt.runtime.tensorrt.plugin_cases import K2_EXPERTS, K2_RANGE, large_case

    plugins.register_plugins()
    compiled = _real_compiles(monkeypatch, aot_compiled)
    for experts in (K2_EXPERTS, K2_RANGE):
        case = large_case(experts)
        assert (case.elements > 2**31 - 1) == (experts == K2_EXPERTS)
        results = _emulate(standin, compiled, tmp_path, case.node_case(case.shape_inputs()), run=False)
        assert sorted(results) == [1, 2, 3]
    k2 = K2Config.preset("kimi-k2")
    for aq in (1, 0):
        for form in ("decode", "prefill"):  # + the paged attention's two stages, one launch each
            model = tensorrt_graph(k2, "moe_block", "bfloat16", aq, expert_ranges=3, form=form)
            linears = sum(n.op_type == "Fp8BlockLinear" for n in model.graph.node)
            assert _graph_on_standin(standin, compiled, tmp_path, model) == 3 * (1 + 3 + 3 + 1) + 3 * linears + 2


def test_aot_linear_kernel_is_the_runtime_kernel():
    """The AOT linear uses the runtime kernel's helpers and tiles: the same bits, every tactic."""
    from k2trt.runtime.kernels.fp8_linear import fp8_block_linear as runtime_linear, tactic_config
    from k2trt.runtime.aot import linear as A

    for act, aq, m, n, k in (("float32", 1, 5, 200, 256), ("float32", 0, 3, 130, 200),
                             ("bfloat16", 1, 17, 256, 128), ("float16", 0, 4, 128, 256)):
        dt = getattr(torch, act)
        g = torch.Generator().manual_seed(m * n + k)
        x = torch.randn(m, k, generator=g).to(dt)
        w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
        for tactic in (1, 2):
            if aq and k % 128:
                continue
            launch = A.linear_launch(act, n, k, aq, tactic)
            y = torch.empty(m, n, dtype=dt)
            A.fp8_linear_aot_kernel[(launch.grid_x(m),)](x, w, s, m, y, **launch.constexprs())
            assert_close(y, reference_linear(x, w, s, aq))  # one ulp of the output dtype
            assert torch.equal(y, runtime_linear(x, w, s, aq, config=tactic_config(tactic, n, k, dt, aq)))


def test_aot_plan_checks():
    from k2trt.runtime.aot import linear as A
    from k2trt.runtime.aot import moe as AM

    with pytest.raises(ValueError, match="multiple of 128"):
        A.linear_launch("bfloat16", 256, 200, 1, 1)
    with pytest.raises(ValueError, match="unknown tactic"):
        A.linear_launch("bfloat16", 256, 256, 1, 9)
    with pytest.raises(ValueError, match="unknown tactic"):
        AM.gemm_launch("down", 4, 256, 128, "bfloat16", 1, 0)
    # W8A8 quantizes x and h per 128 channels and re-quantizes h per 128-wide tile: whole groups only
    with pytest.raises(ValueError, match="gate_up W8A8 needs I a multiple of 128, got 200"):
        AM.gemm_launch("gate_up", 4, 200, 256, "bfloat16", 1, 1)
    with pytest.raises(ValueError, match="down W8A8 needs I a multiple of 128, got 200"):
        AM.gemm_launch("down", 4, 256, 200, "bfloat16", 1, 1)
    assert AM.gemm_launch("gate_up", 4, 200, 200, "bfloat16", 0, 1).out_cols == 200  # W8A16: any size
    launch = A.linear_launch("bfloat16", 7168, 2048, 1, 3)
    assert launch.grid_x(300) == 3 * 56
    assert launch.shrink().num_stages == launch.num_stages - 1
    g = AM.gemm_launch("gate_up", 384, 2048, 7168, "bfloat16", 1, 3)
    while g.shrink() is not None:  # gate+up keeps its 128-wide groups however far it shrinks
        g = g.shrink()
        assert g.block_n == 128
    # the grid works on TensorRT expressions with only + - * // and tensorrt.plugin.min
    with S.expression_builder():  # TensorRT evaluates the grid rule inside get_launch_params
        e = AM.gemm_launch("down", 384, 7168, 2048, "bfloat16", 1, 1).grid(S.dim(64, True), None,
                                                                           minimum=S.minimum)
    assert e[0].value == moe_kernels().gemm_grid(64, 384, 7168, moe_kernels().GEMM_TACTICS[1])


def moe_kernels():
    from k2trt.runtime.kernels import moe

    return moe


PTX = """.version 8.7
.target sm_90a
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3
)
.reqntid 128
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b32 \t%r1, [k_param_1];
\tld.param.b64 \t%rd2, [k_param_2];
}
"""


def test_unused_trailing_ptx_params_are_stripped_and_entries_renamed():
    from k2trt.runtime.aot.ptx import ptx_version_of, rename_entry, strip_unused_params

    out = strip_unused_params(PTX, "k", 3)
    assert "k_param_3" not in out and "k_param_2" in out
    with pytest.raises(ValueError, match="reads its extra parameter k_param_2"):
        strip_unused_params(PTX, "k", 2)
    renamed = rename_entry(out, "k", "k2trt_k_1")
    assert ".entry k2trt_k_1(" in renamed and "[k2trt_k_1_param_0]" in renamed and "k_param" not in \
        renamed.replace("k2trt_k_1_param", "")
    assert ptx_version_of(renamed) == (8, 7)


@pytest.mark.slow
def test_aot_kernels_compile_to_ptx_for_hopper():
    """Every AOT launch compiled for sm_90 with the PTX version a CUDA 12.9 driver loads: `.version 8.8`, a unique
    `k2trt_` entry per launch and per call, exactly TensorRT's launch parameters, cp.async where the tiles pipeline
    (pointers are declared 16-byte aligned), shared memory within the AOT limit."""
    code = textwrap.dedent("""
        import re
        from k2trt.runtime.aot import ptx as aot
        from k2trt.runtime.aot import linear as aot_linear
        from k2trt.runtime.aot import moe as aot_moe
        from k2trt.runtime.aot import moe_int4 as aot_moe_int4
        target = aot.Target(90, 88)
        launches = [aot_moe.AlignLaunch(16), aot_moe.CombineLaunch(256, 2, "bfloat16"),
                 aot_moe.gemm_launch("gate_up", 16, 128, 256, "bfloat16", 1, 1),
                 aot_moe.gemm_launch("down", 16, 256, 512, "bfloat16", 1, 1),
                 aot_linear.linear_launch("bfloat16", 1536, 7168, 1, 1), aot_linear.linear_launch("bfloat16", 1536, 7168, 1, 1),
                 aot_moe_int4.int4_gemm_launch("gate_up", 16, 128, 256, 32, "bfloat16", 3),
                 aot_moe_int4.int4_gemm_launch("down", 16, 256, 128, 32, "bfloat16", 2)]
        names = set()
        for launch in launches:
            launch, k = aot.compile_launch(launch, target)
            assert aot.ptx_version_of(k.ptx) == (8, 8), (launch.label, aot.ptx_version_of(k.ptx))
            entries = re.findall(r"\\.visible \\.entry (\\w+)\\(", k.ptx)
            assert entries == [k.name] and k.name.startswith("k2trt_" + launch.label), (entries, k.name)
            assert k.name not in names
            names.add(k.name)
            runtime = [n for n in launch.kernel.arg_names if n not in launch.constexprs()]
            head = k.ptx[k.ptx.index(".entry " + k.name):]
            assert head[:head.index(")")].count(".param") == len(runtime), launch.label
            assert k.shared <= aot.AOT_SHARED_LIMIT and k.block_x == launch.num_warps * 32
            if launch.num_stages > 1:
                assert "cp.async" in k.ptx, launch.label
        print("ok", len(names))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok 8" in r.stdout


# ---- build helpers -------------------------------------------------------------------------------------------

def test_parser_errors_become_one_line():
    line = B.format_parser_errors("trt/moe_block.onnx", [
        ("Fp8BlockLinear_12", "Fp8BlockLinear", "Plugin not found: k2trt::Fp8BlockLinear\nmore"),
        ("MoeAlign_3", "MoeAlign", "Plugin not found")])
    assert line == ("trt/moe_block.onnx: TensorRT's ONNX parser failed at node 'Fp8BlockLinear_12' "
                    "(Fp8BlockLinear): Plugin not found: k2trt::Fp8BlockLinear (+1 more)")
    assert "\n" not in B.format_parser_errors("g", [])


def test_network_inputs_checked_against_the_manifest():
    ok = [("hidden_states", (-1, -1, 8)), ("attention_mask", (-1, -1, -1)), ("latent_cache", (-1, -1, 12)),
          ("table", (3,)), ("w", (4, 8))]
    B.check_network_inputs(ok, TOY_GRAPH, "toy")
    with pytest.raises(K2Error, match="input 'w' parsed as"):
        B.check_network_inputs(ok[:-1] + [("w", (-1, 8))], TOY_GRAPH, "toy")
    with pytest.raises(K2Error, match="differ from the manifest"):
        B.check_network_inputs(ok[:-1], TOY_GRAPH, "toy")


def test_network_flags_are_tensorrts():
    class Flag10:  # NvInfer.h, TensorRT 10.x
        STRONGLY_TYPED = S.NetworkDefinitionCreationFlag.STRONGLY_TYPED

    Flag11 = S.NetworkDefinitionCreationFlag11  # TensorRT 11: strongly typed always, the flag deprecated (0)

    def fake(version, flag):
        return argparse.Namespace(__version__=version, NetworkDefinitionCreationFlag=flag)

    assert B.network_flags(fake("10.13.0", Flag10)) == 1 << 1
    assert B.network_flags(fake("11.1.0", Flag11)) == 0


def test_build_progress_lines():
    from k2trt.runtime.engines.monitor import BuildProgress

    now = [0.0]
    lines = []
    p = BuildProgress("[1/4] moe_block", lines.append, clock=lambda: now[0], interval=5.0)
    p.phase_start("Building engine", None, 3)
    p.phase_start("Tactic selection", "Building engine", 100)
    p.phase_start("inner detail", "Tactic selection", 1)  # below max_depth: not shown
    for step in range(100):
        now[0] += 0.1
        assert p.step_complete("Tactic selection", step) is True
    p.phase_finish("inner detail")
    p.phase_finish("Tactic selection")
    p.phase_finish("Building engine")
    assert lines[0] == "  [1/4] moe_block: Building engine (3 steps)"
    assert lines[1] == "  [1/4] moe_block:   Tactic selection (100 steps)"
    assert sum("Tactic selection:" in line for line in lines) == 2  # the first step, then at most every 5 s
    assert lines[-2] == "  [1/4] moe_block:   Tactic selection done in 10.0 s"
    assert lines[-1] == "  [1/4] moe_block: Building engine done in 10.0 s"


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the message shown where TensorRT is missing")
def test_build_without_tensorrt_says_so_in_one_line(exported, tmp_path, capsys):
    rc = main(["build", "--onnx", str(exported), "--out", str(tmp_path / "engines")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "k2trt build: error: TensorRT is not installed (pip install 'k2trt[gpu]' on an NVIDIA machine)\n"
    assert not (tmp_path / "engines").exists()


def test_build_reports_input_errors_before_needing_tensorrt(exported, tmp_path, capsys):
    rc = main(["build", "--onnx", str(exported), "--out", str(tmp_path / "e"), "--max-seq", "1024"])
    assert rc == 2
    assert capsys.readouterr().err == ("k2trt build: error: --max-prefill 2048 exceeds --max-seq 1024 "
                                       "(a prefill cannot hold more positions than the cache)\n")
    changed = tmp_path / "changed"
    shutil.copytree(exported, changed)
    with open(changed / "trt" / "head.onnx", "ab") as f:
        f.write(b"\0")
    rc = main(["build", "--onnx", str(changed), "--out", str(tmp_path / "e")])
    assert rc == 2 and "head.onnx: changed since export" in capsys.readouterr().err
    rc = main(["build", "--onnx", str(tmp_path / "missing"), "--out", str(tmp_path / "e")])
    assert rc == 2 and "no manifest.json" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the message shown where TensorRT is missing")
def test_plugins_and_backend_without_tensorrt(tmp_path):
    from k2trt.runtime.backends.tensorrt import TrtBackend

    with pytest.raises(MissingDependency, match=r"^TensorRT is not installed \(pip install"):
        plugins.register_plugins()
    with pytest.raises(MissingDependency, match="TensorRT is not installed"):
        TrtBackend(tmp_path, weights=None)


# ---- backend pieces that need no GPU ---------------------------------------------------------------------------

class _Ptr:
    """A tensor as Context.bind sees one: its address, dtype and shape."""

    def __init__(self, ptr, shape=(2,), dtype=torch.float32):
        self.ptr, self.shape, self.dtype = ptr, shape, dtype

    def data_ptr(self):
        return self.ptr


class _RecordingContext:
    """An execution context whose calls return what TensorRT's would (True, or False for a refusal)."""

    def __init__(self, refuse=()):
        self.refuse, self.calls = set(refuse), []

    def _call(self, what, *args):
        self.calls.append((what, *args))
        return what not in self.refuse

    def set_optimization_profile_async(self, p, stream):
        return self._call("profile", p)

    def set_input_shape(self, name, shape):
        return self._call("shape", name)

    def set_tensor_address(self, name, ptr):
        return self._call("address", name, ptr)

    def get_tensor_shape(self, name):
        return (2,)


def test_context_checks_every_binding_and_its_alignment():
    from k2trt.runtime.backends.tensorrt import TENSOR_ALIGNMENT, Context

    entry = {"kind": "moe_block"}
    stream = argparse.Namespace(cuda_stream=0)
    dtypes = {"x": torch.float32}
    ok = _RecordingContext()
    Context(ok, entry, dtypes).bind(1, {"x": _Ptr(4096)}, {"w": _Ptr(8192)}, {"y": _Ptr(512)}, stream)
    assert [c[0] for c in ok.calls] == ["profile", "shape", "address", "address", "address"]
    for refused, message in (("profile", "optimization profile 1"), ("shape", r"shape \(2,\) for x"),
                             ("address", "the address of x")):
        with pytest.raises(K2Error, match=f"TensorRT refused {message}"):
            Context(_RecordingContext([refused]), entry, dtypes).bind(1, {"x": _Ptr(4096)}, {}, {}, stream)
    with pytest.raises(K2Error, match=f"128 bytes past a {TENSOR_ALIGNMENT}-byte boundary"):
        Context(_RecordingContext(), entry, dtypes).bind(2, {"x": _Ptr(4096 + 128)}, {}, {}, stream)


def test_odd_max_seq_gives_aligned_cache_slots():
    """--max-seq 4095: the runtime's capacity is rounded to 4096 (cache.bucket, steps of 16 positions), the engines'
    P range reaches it, every page of a K2-wide bf16 paged latent cache starts 256-byte aligned (64 x 576 x 2 bytes
    a page), and a step's cache, gathered through its page tables, is one contiguous [B, P, 576] tensor of its own,
    whose base the allocator aligns; an unrounded 4095 would put odd sequences of a shared tensor 128 bytes off
    (4095 x 576 x 2 = 128 mod 256)."""
    from k2trt.runtime.backends.contract import CAPACITY_MULTIPLE
    from k2trt.runtime.cache.pools import PagedLatentCache
    from k2trt.runtime.cache.sizing import bucket

    spec = ProfileSpec(max_seq=4095, opt_seq=1024)
    assert spec.max_capacity == 4096 and spec.dim_ranges("decode")["P"] == (1, 1024, 4096)
    check_call_shape(spec, 1, 1, 4096)
    with pytest.raises(K2Error, match="--max-seq 4095"):
        check_call_shape(spec, 1, 1, 4112)
    for needed in (1, 17, 3000, 4090, 4095):
        capacity = bucket(needed, 4095)
        assert capacity % CAPACITY_MULTIPLE == 0 and needed <= capacity <= spec.max_capacity
    assert bucket(3, 8, minimum=1) == 4  # slot counts keep their own steps
    cache = PagedLatentCache([0], 576, torch.bfloat16)
    cache.reserve(70)
    pool = cache.tensors[0]
    assert all((pool[q * cache.page_tokens].data_ptr() - pool.data_ptr()) % 256 == 0 for q in range(cache.pages))
    rows = torch.arange(3 * 4096).reshape(3, 4096) % (cache.pages * cache.page_tokens)
    step = cache.gather(0, rows)
    assert step.shape == (3, 4096, 576) and step.is_contiguous() and step.data_ptr() != pool.data_ptr()
    assert torch.equal(step[1, 5], pool[rows[1, 5]])
    # the same buffer for every layer and step of the same B and P: a decode CUDA graph keeps its cache address
    assert cache.gather(0, rows.flip(0)).data_ptr() == step.data_ptr()
    assert (4095 * 576 * 2) % 256 == 128


def test_cuda_graph_capture_failure_falls_back_with_one_warning(monkeypatch):
    """A capture that fails (TensorRT's enqueue returns False while capturing, as sampleInference.cpp allows) turns
    CUDA graphs off for the rest of the run with one warning line; every later decode block runs plainly."""
    import contextlib

    from k2trt.runtime.backends import tensorrt as TB

    class Stream:
        def synchronize(self):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    be = argparse.Namespace(stream=Stream(), device="cpu")
    warned = []
    graphs = TB.DecodeGraphs(be, warn=warned.append)

    def reset(key):
        graphs.key, graphs.static = key, {"hidden_states": torch.zeros(key[0], 1, 4)}

    def capture(layer, kind, pool, weights):
        raise K2Error("moe_block: TensorRT failed to enqueue the engine (see its log above)\nmore")

    monkeypatch.setattr(graphs, "_reset", reset)
    monkeypatch.setattr(graphs, "_capture", capture)
    inputs = {"hidden_states": torch.ones(2, 1, 4), "kv_pool": torch.zeros(128, 8),
              "page_table": torch.zeros(2, 2, dtype=torch.int32)}
    assert graphs.run(0, "moe_block", inputs, {}) is None
    assert graphs.run(1, "moe_block", inputs, {}) is None  # off: no second capture, no second warning
    assert warned == ["TensorRT: CUDA graph capture failed (moe_block: TensorRT failed to enqueue the engine (see "
                      "its log above)); decode runs without CUDA graphs"]
    assert graphs.memory_bytes == 0


def test_output_shapes_and_weight_upload(exported):
    from k2trt.tiny.synthetic import RandomWeights
    from k2trt.runtime.backends.tensorrt import OutputArena, output_shapes, upload_weights

    graphs = export_manifest.read_manifest(exported)["graphs"]
    entry = graphs["trt/moe_block"]
    assert output_shapes(entry, {"B": 2, "T": 3, "pages": 2, "rows": 256}) == {
        "hidden_states_out": (2, 3, TINY.hidden_size), "latent_new": (2, 3, TINY.latent_dim)}
    # the decode and prefill forms take the same weights: one upload per layer serves both engines
    assert graphs["trt/moe_block.prefill"]["weights"] == entry["weights"]
    assert graphs["trt/moe_block.prefill"]["prep"] == entry["prep"]

    src = RandomWeights(TINY).block_weights(1)
    up = upload_weights(entry, src, torch.bfloat16, "cpu")
    assert set(up) == set(entry["weights"])
    assert up["mlp.experts.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert up["mlp.experts.gate_proj.weight"].shape[0] == TINY.n_routed_experts
    assert up["input_layernorm.weight"].dtype == torch.bfloat16
    assert up["mlp.gate.e_score_correction_bias"].dtype == torch.float32
    bad = dict(src, **{"input_layernorm.weight": src["input_layernorm.weight"][:-1]})
    with pytest.raises(K2Error, match="input_layernorm.weight"):
        upload_weights(entry, bad, torch.bfloat16, "cpu")

    arena = OutputArena("cpu")
    a = arena.get("h", (2, 3), torch.float32)
    b = arena.get("h", (1, 2), torch.float32)
    assert b.data_ptr() == a.data_ptr() and b.shape == (1, 2)
    c = arena.get("h", (4, 4), torch.float32)
    assert c.shape == (4, 4) and arena.buffers["h"].numel() == 16


# ---- k2trt doctor ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(HAVE_TENSORRT and torch.cuda.is_available(), reason="checks the line shown without TensorRT/GPU")
def test_doctor_without_tensorrt_or_gpu_says_which_in_one_line(capsys):
    rc = main(["doctor"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("k2trt doctor: error: ")
    if not HAVE_TENSORRT:
        assert "TensorRT is not installed" in err
    if not torch.cuda.is_available():
        assert "no CUDA GPU is visible" in err


def test_doctor_reports_each_step_in_one_line():
    from k2trt.tools import doctor

    def boom(state):
        raise RuntimeError("parser failed at node 'x'\nstack trace line")

    lines = []
    steps = [doctor.Step("first", lambda s: "fine"), doctor.Step("second", boom, ("first",)),
             doctor.Step("third", lambda s: "never", ("second",)), doctor.Step("fourth", lambda s: "ok", ("first",))]
    assert doctor.run_steps(steps, {}, lines.append) == 1
    assert [line.split(":")[0] for line in lines] == ["  pass  first", "  FAIL  second", "  skip  third (needs",
                                                      "  pass  fourth"]
    assert lines[1] == "  FAIL  second: parser failed at node 'x'"


def test_doctor_checks_every_plugin_and_the_tokens():
    from k2trt.tools import doctor

    names = [s.name for s in doctor.steps()]
    assert names[:2] == ["TensorRT and CUDA", "plugin registration"]
    assert {n.split()[2] for n in names if n.startswith("one-node engine")} == set(plugins.plugin_specs())
    assert names[-3:] == ["tiny model block engines", "8 tokens vs ONNX Runtime", "EAGLE-3 draft on its engines"]


def test_standin_refuses_what_tensorrt_refuses():
    """The stand-in's validators are TensorRT's, not ours: wrong schemas fail, and an aot_impl that declares only
    some attributes registers but fails when TensorRT passes it all of them (get_launch_params)."""
    import numpy as np
    import numpy.typing as npt

    trtp = S.TensorRTPlugin()

    def desc(x, a, b):
        return trtp.from_shape_expr(x.shape_expr, x.dtype)

    # real objects, not PEP 563 strings: TensorRT reads inspect.signature's annotations as they are
    desc.__annotations__ = {"x": S.TensorDesc, "a": npt.NDArray[np.int32], "b": npt.NDArray[np.int32],
                            "return": S.TensorDesc}
    trtp.register("toy::op")(desc)
    with pytest.raises(ValueError, match="expected schema"):
        trtp.impl("toy::op")(lambda x, a, b, outputs: None)  # no stream
    with pytest.raises(ValueError, match="expected schema"):
        trtp.impl("toy::op")(lambda x, b, a, outputs, stream: None)  # attributes out of register order

    def no_return(x, a, b, outputs, tactic):
        pass

    with pytest.raises(ValueError, match="No return annotation"):
        trtp.aot_impl("toy::op")(no_return)

    def only_b(x, b, outputs, tactic):
        return "k", "ptx", S.KernelLaunchParams(), S.SymIntExprs(0)

    only_b.__annotations__ = {"return": tuple[str, str, S.KernelLaunchParams, S.SymIntExprs]}

    trtp.aot_impl("toy::op")(only_b)  # a subset validates...
    plugin = trtp.create_plugin("toy::op", {"a": np.array([1], np.int32), "b": np.array([2], np.int32)},
                                S.QuickPluginCreationRequest.STRICT_AOT)
    plugin.output_shapes([S.TensorDesc([S.dim(4)], S.DataType.FLOAT)])
    with pytest.raises(TypeError):
        plugin.launch(0)  # ...but TensorRT calls aot_impl with every attribute

    def listed(x, a):
        return x

    listed.__annotations__ = {"x": S.TensorDesc, "a": list, "return": S.TensorDesc}
    with pytest.raises(ValueError, match="not a supported serializable type"):
        trtp.register("toy::other")(listed)
