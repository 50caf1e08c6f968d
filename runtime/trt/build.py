"""`k2trt build`: one TensorRT engine per exported block kind, with a prefill and a decode profile.

    k2trt build --onnx build/onnx --out build/engines [--max-batch 8 --max-seq 4096 --max-prefill 2048 ...]
                [--timing-cache FILE] [--aot-linear]

Reads the export manifest, registers our plugins, parses each trt/<kind>.onnx into a strongly typed network,
adds the two profiles (runtime/trt/profiles.py), builds with a shared timing cache, and writes <kind>.engine
atomically plus manifest.json (runtime/trt/engine_manifest.py). Needs TensorRT and an NVIDIA GPU; without them
it stops with one line saying which is missing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from k2trt.atomic import atomic_write_bytes
from k2trt.dirlock import writing
from k2trt.errors import K2Error
from k2trt.export.block_graphs import KINDS
from k2trt.export.manifest import graph_file, read_manifest
from k2trt.runtime.trt import engine_manifest as EM
from k2trt.runtime.trt import environment
from k2trt.runtime.trt.profiles import (ProfileSpec, add_profile_arguments, graph_profiles, is_dynamic,
                                        spec_from_args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--onnx", type=Path, required=True, help="export directory (written by `k2trt export`)")
    p.add_argument("--out", type=Path, required=True, help="engine directory to write")
    add_profile_arguments(p)
    p.add_argument("--timing-cache", type=Path, help="TensorRT timing cache to read and update (speeds up rebuilds)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="build only these engines")
    p.add_argument("--aot-linear", action="store_true",
                   help="run Fp8BlockLinear nodes as AOT plugins (PTX in the engine, no Python per call)")
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")


def run(args) -> int:
    export = read_manifest(args.onnx)
    spec = spec_from_args(args)
    if args.out.exists() and not args.out.is_dir():
        raise K2Error(f"--out {args.out} exists and is not a directory")
    graphs = {kind: _graph(export, kind, args.onnx) for kind in args.kinds}
    # Only now the heavy dependencies: every input error above is reported without TensorRT.
    trt = environment.import_tensorrt()
    environment.require_cuda()
    from k2trt.runtime.trt.plugins import register_plugins

    modes = register_plugins()  # before parsing: the parser looks our nodes up in the plugin registry
    if args.aot_linear and modes["Fp8BlockLinear"] != "jit+aot":
        raise K2Error(f"--aot-linear needs AOT Python plugins (TensorRT >= 10.10), this is {trt.__version__}")
    env = environment.current_environment()
    print(f"TensorRT {env['tensorrt_version']} on {env['gpu_name']} (sm {env['compute_capability']}); "
          f"profiles: prefill T 1..{spec.max_prefill}, decode T 1; B 1..{spec.max_batch}, P 1..{spec.max_seq}")
    builder = Builder(trt, spec, args.timing_cache, args.verbose)
    engines = {}
    with writing(args.out, "k2trt build"):  # one build at a time; a killed one's temporaries go
        for i, (kind, graph) in enumerate(graphs.items(), 1):
            t0 = time.perf_counter()
            print(f"[{i}/{len(graphs)}] {kind}: building from {graph['file']} ...", flush=True)
            used = plugin_modes(graph, modes, args.aot_linear)
            blob = builder.build(kind, args.onnx / graph["file"], graph, aot_linear=args.aot_linear)
            path = args.out / f"{kind}.engine"
            atomic_write_bytes(path, blob)
            engines[kind] = EM.engine_entry(kind, graph, graph_profiles(spec, graph), path.name,
                                            EM.sha256_file(path), used)
            print(f"[{i}/{len(graphs)}] {kind}: {len(blob) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        builder.save_timing_cache()
        EM.write_engine_manifest(args.out, EM.make_engine_manifest(export, spec, env, engines))
    print(f"engines and manifest.json written to {args.out}")
    return 0


def _graph(export: dict, kind: str, onnx_dir: Path) -> dict:
    graph_file(onnx_dir, export, f"trt/{kind}")  # present and unchanged since export
    return export["graphs"][f"trt/{kind}"]


def plugin_modes(graph: dict, available: dict[str, str], aot_linear: bool) -> dict[str, str]:
    """How each of our plugins runs in this engine: "jit" (Python at enqueue) or "aot" (PTX in the engine)."""
    return {op: ("aot" if aot_linear and mode == "jit+aot" else "jit") for op, mode in available.items()}


# ---- parsing -------------------------------------------------------------------------------------------

def format_parser_errors(label: str, errors: list[tuple[str, str, str]]) -> str:
    """One line for the parser's errors, given as (node name, operator, description)."""
    if not errors:
        return f"{label}: TensorRT's ONNX parser failed without an error message"
    node, op, desc = errors[0]
    where = f" at node {node!r} ({op})" if node else ""
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{label}: TensorRT's ONNX parser failed{where}: {desc.strip().splitlines()[0] if desc else ''}{more}"


def _parser_errors(parser) -> list[tuple[str, str, str]]:
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node_name() if hasattr(e, "node_name") else ""
        op = e.node_operator() if hasattr(e, "node_operator") else ""
        out.append((node, op, e.desc()))
    return out


def with_aot_attribute(model_path: Path) -> bytes:
    """The graph with `aot=1` on every node whose plugin has an AOT implementation (the parser's switch)."""
    import onnx
    from onnx import helper

    from k2trt.runtime.trt.plugins import plugin_specs

    model = onnx.load(str(model_path))
    aot_ops = {op for op, s in plugin_specs().items() if s.aot}
    for node in model.graph.node:
        if node.op_type in aot_ops and not any(a.name == "aot" for a in node.attribute):
            node.attribute.append(helper.make_attribute("aot", 1))
    return model.SerializeToString()


def check_network_inputs(network_inputs: list[tuple[str, tuple]], graph: dict, label: str) -> None:
    """The parsed network's inputs are the manifest's, dynamic exactly where the manifest says."""
    declared = {i["name"]: i["shape"] for i in graph["inputs"]}
    names = [n for n, _ in network_inputs]
    if sorted(names) != sorted(declared):
        raise K2Error(f"{label}: network inputs {sorted(names)} differ from the manifest's {sorted(declared)}")
    for name, shape in network_inputs:
        want = declared[name]
        if len(shape) != len(want) or any((d == -1) != (not isinstance(w, int)) or (d != -1 and d != w)
                                          for d, w in zip(shape, want)):
            raise K2Error(f"{label}: input {name!r} parsed as {list(shape)}, manifest says {want}")
    if not any(is_dynamic(s) for s in declared.values()):
        raise K2Error(f"{label}: no dynamic input; expected B and T dims")


class Builder:
    """One TensorRT builder and timing cache for all engines of a build."""

    def __init__(self, trt, spec: ProfileSpec, timing_cache: Path | None, verbose: bool = False):
        self.trt, self.spec, self.cache_path = trt, spec, timing_cache
        self.logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        data = timing_cache.read_bytes() if timing_cache and timing_cache.exists() else b""
        self._cache_config = self.builder.create_builder_config()
        self.cache = self._cache_config.create_timing_cache(data)

    def network_flags(self) -> int:
        # TensorRT 11 networks are always strongly typed (flag 0); on 10.x ask for it explicitly.
        flag = getattr(self.trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if environment.tensorrt_major(self.trt.__version__) >= 11 or flag is None:
            return 0
        return 1 << int(flag)

    def build(self, kind: str, path: Path, graph: dict, aot_linear: bool = False) -> bytes:
        trt = self.trt
        label = graph["file"]
        network = self.builder.create_network(self.network_flags())
        parser = trt.OnnxParser(network, self.logger)
        ok = parser.parse(with_aot_attribute(path), str(path)) if aot_linear else parser.parse_from_file(str(path))
        if not ok:
            raise K2Error(format_parser_errors(label, _parser_errors(parser)))
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        check_network_inputs([(t.name, tuple(t.shape)) for t in inputs], graph, label)
        config = self.builder.create_builder_config()
        for prof in graph_profiles(self.spec, graph):
            p = self.builder.create_optimization_profile()
            for name, r in prof.shapes.items():
                p.set_shape(name, r.min, r.opt, r.max)
            config.add_optimization_profile(p)
        config.set_timing_cache(self.cache, False)
        blob = self.builder.build_serialized_network(network, config)
        if blob is None:
            raise K2Error(f"{label}: TensorRT could not build the {kind} engine (see its log above)")
        return bytes(blob)

    def save_timing_cache(self) -> None:
        if self.cache_path is not None:
            atomic_write_bytes(self.cache_path, bytes(self.cache.serialize()))
