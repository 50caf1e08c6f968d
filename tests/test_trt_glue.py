"""The TensorRT glue that runs without TensorRT: profiles, the engine manifest and its checks, the plugin
descriptions against the node contracts and the exported nodes, the AOT linear kernel (under Triton's interpreter
and compiled to PTX), and the one-line errors of `k2trt build` / the backend where TensorRT is missing."""

from __future__ import annotations

import argparse
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

from k2trt.cli import main
from k2trt.config import K2Config
from k2trt.errors import K2Error, MissingDependency
from k2trt.export import manifest as export_manifest
from k2trt.export.block_graphs import build_block_graph
from k2trt.export.onnx_ops import elem as onnx_elem
from k2trt.graphs import contracts
from k2trt.graphs.fp8 import fp8_block_linear as reference_linear
from k2trt.graphs.fp8 import quantize_weight
from k2trt.runtime.trt import build as B
from k2trt.runtime.trt import engine_manifest as EM
from k2trt.runtime.trt import plugins as P
from k2trt.runtime.trt.profiles import (DECODE, PREFILL, Profile, ProfileError, ProfileSpec, ShapeRange,
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
    entry = export_manifest.read_manifest(exported)["graphs"]["trt/moe_block"]
    prefill, decode = graph_profiles(ProfileSpec(), entry)
    assert set(prefill.shapes) == {"hidden_states", "rope_cos", "rope_sin", "attention_mask", "latent_cache"}
    assert prefill.shapes["attention_mask"].max == (8, 2048, 4096 + 2048)
    assert decode.shapes["latent_cache"].opt == (1, 1024, TINY.latent_dim)
    assert decode.shapes["rope_cos"].max == (8, 1, TINY.qk_rope_head_dim // 2)


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
                                        EM.sha256_file(path), {"Fp8BlockLinear": "jit", "MoeFp8": "jit"})
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


# ---- plugins ↔ contracts ↔ exported nodes ---------------------------------------------------------------------

def test_plugin_specs_behave():
    specs = P.plugin_specs()
    for spec in specs.values():
        assert spec.version == P.QDP_PLUGIN_VERSION  # what tensorrt.plugin registers every plugin as
        assert not set(spec.attribute_names) & set(P.PARSER_ATTRIBUTES)  # the parser would swallow them
    assert specs["Fp8BlockLinear"].output_shape([[2, 3, 256], [512, 256], [4, 2]]) == [2, 3, 512]
    assert specs["MoeFp8"].output_shape([[2, 3, 256]] + [[1]] * 8) == [2, 3, 256]
    assert (specs["Fp8BlockLinear"].aot, specs["MoeFp8"].aot) == (True, False)


def test_plugin_functions_have_the_signatures_tensorrt_checks():
    for op, spec in P.plugin_specs().items():
        desc, impl, autotune, aot = P.PLUGIN_FUNCTIONS[op]
        expected = P.expected_signatures(spec)
        got = {"register": desc, "impl": impl, "autotune": autotune}
        if aot is not None:
            got["aot_impl"] = aot
        assert set(got) == set(expected)
        for role, fn in got.items():
            assert list(inspect.signature(fn).parameters) == expected[role], (op, role)


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    return {v.name: v.type for v in list(g.input) + list(g.value_info) + list(g.output)}


def _dims(t: onnx.TypeProto) -> list:
    return [d.dim_param or d.dim_value for d in t.tensor_type.shape.dim]


@pytest.mark.parametrize("kind, act", [("moe_block", "bfloat16"), ("dense_block", "float32")])
def test_exported_nodes_match_the_plugins(kind, act):
    model = build_block_graph(TINY, kind, act)
    types = _value_types(model)
    specs = P.plugin_specs()
    custom = [n for n in model.graph.node if n.domain == contracts.NAMESPACE]
    assert {n.op_type for n in custom} == ({"Fp8BlockLinear", "MoeFp8"} if kind == "moe_block" else {"Fp8BlockLinear"})
    for node in custom:
        spec = specs[node.op_type]
        attrs = {a.name: a for a in node.attribute}
        assert attrs["plugin_namespace"].s.decode() == spec.namespace
        assert attrs["plugin_version"].s.decode() == spec.version
        # exactly the attributes the plugin declares, besides those the parser reads itself
        assert set(attrs) - set(P.PARSER_ATTRIBUTES) == set(spec.attribute_names)
        for name, typ in spec.attributes:
            assert attrs[name].type == {"int": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT,
                                        "str": onnx.AttributeProto.STRING}[typ]
        assert len(node.input) == len(spec.inputs) and len(node.output) == len(spec.outputs)
        io_types = []
        for port, value in zip(spec.inputs + spec.outputs, list(node.input) + list(node.output)):
            elem = types[value].tensor_type.elem_type
            assert elem in {onnx_elem(d) for d in port.dtypes}, (node.name, port.name)
            if port.follows_activation:
                assert elem == onnx_elem(act), (node.name, port.name)
            io_types.append(P.autotune_type(act if port.follows_activation else port.dtypes[0]))
        assert ",".join(io_types) in spec.type_combinations()
        # the output shape rule agrees with the exporter's annotation wherever a dim is static
        rule = spec.output_shape([_dims(types[v]) for v in node.input])
        annotated = _dims(types[node.output[0]])
        assert len(rule) == len(annotated), node.name
        for r, a in zip(rule, annotated):
            assert not (isinstance(r, int) or isinstance(a, int)) or r == a, (node.name, rule, annotated)


def test_aot_attribute_is_added_only_to_aot_plugins(tmp_path):
    path = tmp_path / "moe.onnx"
    onnx.save_model(build_block_graph(TINY, "moe_block", "bfloat16"), str(path))
    model = onnx.load_from_string(B.with_aot_attribute(path))
    for node in model.graph.node:
        aot = [a.i for a in node.attribute if a.name == "aot"]
        assert aot == ([1] if node.op_type == "Fp8BlockLinear" else []), node.name


def test_cuda_array_interface_for_types_tensorrt_refuses():
    iface = P.cuda_array_interface(1234, (2, 3), (3, 1), "bfloat16")
    assert iface == {"shape": (2, 3), "typestr": "<u2", "data": (1234, False), "version": 3, "strides": (6, 2)}
    assert P.cuda_array_interface(8, (4,), None, "float8_e4m3fn")["typestr"] == "|u1"
    import numpy as np

    for port in (p for c in contracts.CONTRACTS.values() for p in c.inputs + c.outputs):
        for dtype in port.dtypes:  # every type a plugin sees travels with its own item size
            assert np.dtype(P.interface_typestr(dtype)).itemsize == getattr(torch, dtype).itemsize


# ---- the AOT linear kernel ---------------------------------------------------------------------------------------

def test_aot_kernel_argument_order_is_tensorrts():
    from k2trt.runtime.trt import aot_linear as A

    spec = P.plugin_specs()["Fp8BlockLinear"]
    assert list(A.KERNEL_TENSOR_ARGS) == spec.input_names
    assert list(A.KERNEL_OUTPUT_ARGS) == [p.name for p in spec.outputs]
    plan = A.plan_for("bfloat16", 512, 256, 1, 1)
    runtime_args = [n for n, t in plan.signature().items() if t != "constexpr"]
    assert runtime_args == ["x_ptr", "w_ptr", "ws_ptr", "M", "y_ptr"]  # inputs, extra scalars, outputs
    assert set(A.TACTIC_ROWS) == set(spec.tactics)


@pytest.mark.parametrize("act, aq, m, n, k", [
    ("float32", 1, 5, 200, 256), ("float32", 0, 3, 130, 200), ("bfloat16", 1, 17, 256, 128),
    ("float16", 0, 4, 128, 256),
])
def test_aot_kernel_matches_the_reference_and_the_runtime_kernel(act, aq, m, n, k):
    from k2trt.runtime.kernels.fp8_linear import fp8_block_linear as runtime_linear
    from k2trt.runtime.trt import aot_linear as A

    dt = getattr(torch, act)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dt)
    w, s = quantize_weight(torch.randn(n, k, generator=g) * 0.05)
    plan = A.plan_for(act, n, k, aq, 1)
    y = torch.empty(m, n, dtype=dt)
    A.fp8_linear_aot_kernel[(plan.grid_x(m),)](x, w, s, m, y, **plan.constexprs())
    torch.testing.assert_close(y.float(), reference_linear(x, w, s, aq).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, runtime_linear(x, w, s, aq))  # same helpers, same tiles: same bits


def test_aot_plan_checks():
    from k2trt.runtime.trt import aot_linear as A

    with pytest.raises(ValueError, match="multiple of 128"):
        A.plan_for("bfloat16", 256, 200, 1, 1)
    with pytest.raises(ValueError, match="unknown tactic"):
        A.plan_for("bfloat16", 256, 256, 1, 9)
    plan = A.plan_for("bfloat16", 7168, 2048, 1, 3)
    assert plan.grid_x(300) == 3 * 56
    smaller = plan.shrink()
    assert smaller.num_stages == plan.num_stages - 1


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


def test_unused_trailing_ptx_params_are_stripped():
    from k2trt.runtime.trt.aot_linear import strip_unused_params

    out = strip_unused_params(PTX, "k", 3)
    assert "k_param_3" not in out and "k_param_2" in out
    with pytest.raises(ValueError, match="reads its extra parameter k_param_2"):
        strip_unused_params(PTX, "k", 2)


@pytest.mark.slow
def test_aot_kernel_compiles_to_ptx_for_hopper():
    # Triton's compiler refuses interpreted functions: compile in a process without TRITON_INTERPRET.
    code = textwrap.dedent("""
        from triton.backends.compiler import GPUTarget
        from k2trt.runtime.trt.aot_linear import AOT_SHARED_LIMIT, compile_plan, plan_for
        plan, name, ptx, block_x, shared = compile_plan(plan_for("bfloat16", 7168, 2048, 1, 1),
                                                        target=GPUTarget("cuda", 90, 32))
        entry = ptx[ptx.index(".entry " + name):]
        params = entry[:entry.index(")")].count(".param")
        assert params == 5, params
        assert block_x == plan.num_warps * 32 and shared <= AOT_SHARED_LIMIT
        print("ok", name)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok fp8_linear_aot_kernel" in r.stdout


# ---- build helpers -------------------------------------------------------------------------------------------

def test_parser_errors_become_one_line():
    line = B.format_parser_errors("trt/moe_block.onnx", [
        ("Fp8BlockLinear_12", "Fp8BlockLinear", "Plugin not found: k2trt::Fp8BlockLinear\nmore"),
        ("MoeFp8_3", "MoeFp8", "Plugin not found")])
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


def test_network_flags_and_plugin_modes():
    class Flag:
        STRONGLY_TYPED = 2

    def fake(version):
        return argparse.Namespace(trt=argparse.Namespace(__version__=version, NetworkDefinitionCreationFlag=Flag))

    assert B.Builder.network_flags(fake("11.4.0")) == 0
    assert B.Builder.network_flags(fake("10.13.0")) == 1 << 2
    avail = {"Fp8BlockLinear": "jit+aot", "MoeFp8": "jit"}
    assert B.plugin_modes({}, avail, True) == {"Fp8BlockLinear": "aot", "MoeFp8": "jit"}
    assert B.plugin_modes({}, avail, False) == {"Fp8BlockLinear": "jit", "MoeFp8": "jit"}


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
    from k2trt.runtime.trt.backend import TrtBackend

    with pytest.raises(MissingDependency, match=r"^TensorRT is not installed \(pip install"):
        P.register_plugins()
    with pytest.raises(MissingDependency, match="TensorRT is not installed"):
        TrtBackend(tmp_path, weights=None)


# ---- backend pieces that need no GPU ---------------------------------------------------------------------------

def test_output_shapes_and_weight_upload(exported):
    from k2trt.tools.synthetic import RandomWeights
    from k2trt.runtime.trt.backend import OutputArena, output_shapes, upload_weights

    entry = export_manifest.read_manifest(exported)["graphs"]["trt/moe_block"]
    assert output_shapes(entry, {"B": 2, "T": 3, "P": 16}) == {
        "hidden_states_out": (2, 3, TINY.hidden_size), "latent_new": (2, 3, TINY.latent_dim)}

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


# ---- registration wiring, against a stand-in for tensorrt.plugin -----------------------------------------------

class _FakeTrtp:
    """Just enough of tensorrt.plugin to run register_plugins and the plugin functions on CPU: it records the
    decorated functions and applies TensorRT's rule that register parameters are annotated."""

    class TensorDesc:
        def __init__(self, shape_expr=(), dtype=None):
            self.shape_expr, self.dtype = list(shape_expr), dtype

        @property
        def ndim(self):
            return len(self.shape_expr)

    class KernelLaunchParams:
        pass

    class SymExprs:
        pass

    class SymIntExprs(SymExprs, list):
        def __init__(self, n):
            list.__init__(self, [None] * n)

    def __init__(self):
        self.registered = {}

    def _recorder(self, role):
        def decorator_for(plugin_id):
            def record(fn):
                self.registered[(plugin_id, role)] = fn
                return fn
            return record
        return decorator_for

    def __getattr__(self, role):
        if role in ("register", "impl", "autotune", "aot_impl"):
            return self._recorder(role)
        raise AttributeError(role)

    @staticmethod
    def from_shape_expr(dims, dtype):
        return ("desc", tuple(dims), dtype)

    @staticmethod
    def AutoTuneCombination(types, layouts, tactics):
        return (types, layouts, tactics)

    @staticmethod
    def SymInt32(e):
        return ("i32", e)


class _Dim(int):
    is_fake, is_constant = False, True

    def constant_value(self):
        return int(self)


def test_register_plugins_wires_every_function(monkeypatch):
    fake = _FakeTrtp()
    from k2trt.runtime.trt import environment

    monkeypatch.setattr(environment, "import_tensorrt_plugin", lambda: (None, fake))
    monkeypatch.setattr(P, "_REGISTERED", set())
    trt_module = argparse.Namespace(plugin=fake)
    monkeypatch.setitem(sys.modules, "tensorrt", trt_module)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", fake)

    assert P.register_plugins() == {"Fp8BlockLinear": "jit+aot", "MoeFp8": "jit"}
    assert set(fake.registered) == {("k2trt::Fp8BlockLinear", r) for r in ("register", "impl", "autotune", "aot_impl")} \
        | {("k2trt::MoeFp8", r) for r in ("register", "impl", "autotune")}
    for op, spec in P.plugin_specs().items():
        desc = fake.registered[(spec.plugin_id, "register")]
        params = inspect.signature(desc).parameters
        assert all(params[n].annotation is fake.TensorDesc for n in spec.input_names)
        assert all(params[a].annotation is int for a in spec.attribute_names)
        assert inspect.signature(desc).return_annotation is fake.TensorDesc

    bf16 = argparse.Namespace(name="BF16")
    x = fake.TensorDesc(["B", "T", 256], bf16)
    w = fake.TensorDesc([_Dim(512), _Dim(256)], argparse.Namespace(name="FP8"))
    s = fake.TensorDesc([4, 2], argparse.Namespace(name="FLOAT"))
    assert P.fp8_block_linear_desc(x, w, s, 1) == ("desc", ("B", "T", 512), bf16)
    combos = P.fp8_block_linear_autotune(x, w, s, ())
    assert ("BF16,FP8,FLOAT,BF16", "LINEAR,LINEAR,LINEAR,LINEAR", [1, 2, 3]) in combos

    from k2trt.runtime.trt import aot_linear as A

    monkeypatch.setattr(A, "compile_plan", lambda plan: (plan, "kern", ".ptx", plan.num_warps * 32, 1024))
    x.shape_expr[:2] = [6, 5]  # B·T = 30 rows
    name, ptx, params, extra = P.fp8_block_linear_aot_impl(x, w, s, 1, (), 1)
    plan = A.plan_for("bfloat16", 512, 256, 1, 1)
    assert (name, ptx, params.block_x, params.shared_mem) == ("kern", ".ptx", plan.num_warps * 32, 1024)
    assert params.grid_x == plan.grid_x(30) and list(extra) == [("i32", 30)]
