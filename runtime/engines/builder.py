"""`k2trt build`: one TensorRT engine per exported block kind and form (an attention kind's decode and prefill
graphs: export/trt_form.py), each with a prefill and a decode profile.

    k2trt build --onnx build/onnx --out build/engines [--max-batch 8 --max-seq 4096 --max-prefill 2048 ...]
                [--timing-cache FILE] [--plugins aot|jit]

Reads the export manifest, registers our plugins, writes the `aot` attribute on every plugin node, parses each
trt/<kind>.onnx into a strongly typed network, adds the two profiles (runtime/tensorrt/profiles.py), builds with a
shared timing cache (showing TensorRT's progress), and writes <kind>.engine atomically plus manifest.json
(runtime/tensorrt/engine_manifest.py). Needs TensorRT and an NVIDIA GPU; without them it stops with one line saying
which is missing.

The JIT/AOT rule, decided once: every plugin node gets an explicit `aot` (1 by default: the engine runs without
Python; 0 with --plugins jit, for debugging). A node with both implementations registered and no `aot` attribute
is refused by TensorRT's plugin creator unless the network has a PREFER_*_PYTHON_PLUGINS flag (tensorrt/plugin/
_lib.py _TemplatePluginCreator.create_plugin), and the node-level attribute overrides any flag (onnx-tensorrt
importerUtils.cpp createPlugin), so the attribute alone decides and no flag is set.
"""

from __future__ import annotations

import time
from pathlib import Path

from k2trt.atomic import atomic_write_bytes
from k2trt.dirlock import writing
from k2trt.errors import K2Error
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.export.trt_form import engine_names
from k2trt.export_manifest import graph_file, read_manifest
from k2trt.runtime.tensorrt import engine_manifest as EM
from k2trt.runtime.tensorrt import environment
from k2trt.runtime.engines.monitor import BuildProgress, progress_monitor
from k2trt.runtime.tensorrt.profiles import (ProfileSpec, graph_profiles, is_dynamic, pages_for, spec_from_args)


PLUGIN_MODES = ("aot", "jit")


def run(args) -> int:
    build_engines(args.onnx, args.out, spec_from_args(args), args.kinds, args.plugins, args.timing_cache,
                  args.verbose)
    return 0


def build_engines(onnx_dir: Path, out: Path, spec: ProfileSpec, kinds=None, plugins: str = "aot",
                  timing_cache: Path | None = None, verbose: bool = False, log=None, logger=None) -> dict:
    """Build the engines of an export directory into `out` and write its manifest; -> the engine manifest.
    kinds: default every block kind, the MoE parts the export has (--expert-parallel) and its EAGLE-3 draft's
    graphs (export --draft). log(line) shows progress (default: print, flushed — a build of K2 takes a while)."""
    log = log or (lambda line: print(line, flush=True))
    export = read_manifest(onnx_dir)
    drafts: tuple[str, ...] = ()
    if kinds is None:
        kinds = BLOCK_KINDS + tuple(k for k in MOE_PART_KINDS if f"trt/{k}" in export["graphs"])
        drafts = draft_engine_names(export)
    if out.exists() and not out.is_dir():
        raise K2Error(f"--out {out} exists and is not a directory")
    # every form of each kind: an attention kind's decode and prefill graphs are engines of their own
    graphs = {name: _graph(export, name, onnx_dir) for name in engine_names(kinds) + drafts}
    # Only now the heavy dependencies: every input error above is reported without TensorRT.
    trt = environment.import_tensorrt()
    environment.require_cuda()
    from k2trt.runtime.tensorrt.plugins import register_plugins

    modes = register_plugins()  # before parsing: the parser looks our nodes up in the plugin registry
    aot = plugins == "aot"
    check_plugin_modes(modes, aot, trt.__version__)
    env = environment.current_environment()
    refused = environment.check_tensorrt(env["tensorrt_version"], env.get("tensorrt_cuda"),
                                         environment.driver_cuda_version())
    if refused:
        raise K2Error(refused)
    target = configure_aot_target(env) if aot else None
    log(f"TensorRT {env['tensorrt_version']} on {env['gpu_name']} (sm {env['compute_capability']}, driver CUDA "
        f"{env['cuda_driver']}); plugins: {plugins}"
        + (f", PTX {environment.ptx_text(target.ptx_version)}" if target and target.ptx_version else ""))
    log(f"profiles: prefill T 1..{spec.max_prefill}, decode T 1; B 1..{spec.max_batch}, P 1..{spec.max_capacity} "
        f"(pages 1..{pages_for(spec.max_capacity)}, pool pages ..{spec.pool_pages})")
    if timing_cache is not None:
        timing_cache = timing_cache_file(timing_cache, export["act_dtype"], export.get("activation_quant"))
        log(f"timing cache: {timing_cache}")
    builder = Builder(trt, spec, timing_cache, verbose, logger)
    engines = {}
    out.mkdir(parents=True, exist_ok=True)
    with writing(out, "k2trt build"):  # one build at a time; a killed one's temporaries go
        t_all = time.perf_counter()
        for i, (kind, graph) in enumerate(graphs.items(), 1):
            t0 = time.perf_counter()
            label = f"[{i}/{len(graphs)}] {kind}"
            log(f"{label}: building from {graph['file']} ...")
            model, used = with_aot_attribute(onnx_dir / graph["file"], aot)
            blob = builder.build(kind, model, graph, BuildProgress(label, log))
            path = out / f"{kind}.engine"
            atomic_write_bytes(path, blob)
            engines[kind] = EM.engine_entry(kind, graph, graph_profiles(spec, graph), path.name,
                                            EM.sha256_file(path), used)
            log(f"{label}: {len(blob) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
        builder.save_timing_cache()
        ptx = None if target is None else target.ptx_version
        manifest = EM.make_engine_manifest(export, spec, env, engines, ptx)
        EM.write_engine_manifest(out, manifest)
        log(f"engines and manifest.json written to {out} ({time.perf_counter() - t_all:.1f} s)")
    return manifest


def timing_cache_file(path: Path, act: str, activation_quant: int | None) -> Path:
    """The timing cache of one activation dtype and FP8 mode. TensorRT keys a plugin's timings by its name, I/O
    types, formats and shapes plus the suffix getTimingCacheID() returns, which should carry "other factors
    determining the creation state of the plugin, such as its attribute values" (NvInferRuntime.h); tensorrt.plugin's
    AOT plugins return "" (_plugin_class.py _TemplateAOTPlugin.get_timing_cache_id), so a W8A8 and a W8A16 linear —
    same I/O types — would take each other's timings from a shared cache."""
    from k2trt.graphs.fp8 import WEIGHT_DEQUANT

    mode = "w8a16" if activation_quant == WEIGHT_DEQUANT else "w8a8"
    return path.with_name(f"{path.stem}.{act}-{mode}{path.suffix}")


def check_plugin_modes(modes: dict[str, str], aot: bool, version: str) -> None:
    """AOT engines need every plugin to have its AOT implementation registered (TensorRT >= 10.9)."""
    from k2trt.runtime.tensorrt.plugins import AOT_PLUGINS_SINCE

    if aot and any(m != "jit+aot" for m in modes.values()):
        raise K2Error(f"AOT plugins need TensorRT >= {AOT_PLUGINS_SINCE}, this is {version}; "
                      "build with --plugins jit")


def configure_aot_target(env: dict):
    """Compile AOT kernels for this GPU, with a PTX version this driver (and Triton's ptxas) accepts."""
    from k2trt.runtime.aot import ptx as aot

    major, minor = (int(v) for v in env["compute_capability"].split("."))
    arch = major * 10 + minor
    driver = tuple(int(v) for v in env["cuda_driver"].split(".")) if env.get("cuda_driver") else None
    target = aot.Target(arch, environment.ptx_version_for(driver, environment.triton_ptx_version(arch),
                                                          env.get("tensorrt_cuda")))
    aot.configure(target)
    return target


def draft_engine_names(export: dict) -> tuple[str, ...]:
    """The engines of the export's EAGLE-3 draft (export/draft_graphs.py), one per TensorRT graph of it."""
    return tuple(key[len("trt/"):] for key in export["graphs"] if key.startswith("trt/draft_"))


def _graph(export: dict, kind: str, onnx_dir: Path) -> dict:
    graph_file(onnx_dir, export, f"trt/{kind}")  # present and unchanged since export
    return export["graphs"][f"trt/{kind}"]


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


def with_aot_attribute(model_path: Path, aot: bool) -> tuple[bytes, dict[str, str]]:
    """The graph file with an explicit `aot` on every plugin node (set_aot_attribute), serialized for the parser."""
    import onnx

    model = onnx.load(str(model_path))
    used = set_aot_attribute(model, aot)
    return model.SerializeToString(), used


def set_aot_attribute(model, aot: bool) -> dict[str, str]:
    """Write `aot` (1 or 0) on every plugin node, replacing any; -> how each plugin of the graph runs
    (op_type -> "aot" | "jit"). The parser reads `aot` as an int attribute (onnx-tensorrt importerUtils.cpp).
    A node whose kernel has no AOT form in the node's activation dtype (runtime/aot/nodes.AotNode.acts: the MLA
    stages in float32, whose tiles need more than an AOT launch's 48 KiB) runs JIT in an AOT engine too."""
    from onnx import helper

    from k2trt.dtypes import BY_ONNX
    from k2trt.export.onnx_ops import value_types
    from k2trt.graphs import contracts
    from k2trt.runtime.aot.nodes import AOT_NODES
    from k2trt.runtime.tensorrt.plugins import check_input_dtypes

    types = value_types(model) if aot else {}
    used = {}
    for node in model.graph.node:
        if node.domain != contracts.NAMESPACE:
            continue
        node_aot = aot
        if aot:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            act = check_input_dtypes(node.op_type, [BY_ONNX[types[v].elem_type].name for v in node.input], attrs)
            node_aot = AOT_NODES[node.op_type].has_aot(act)
        for a in [a for a in node.attribute if a.name == "aot"]:
            node.attribute.remove(a)
        node.attribute.append(helper.make_attribute("aot", int(node_aot)))
        used[node.op_type] = "aot" if node_aot else "jit"
    return dict(sorted(used.items()))


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


def network_flags(trt) -> int:
    """TensorRT 11 networks are always strongly typed (its kSTRONGLY_TYPED is deprecated and ignored); on 10.x ask
    for it (kSTRONGLY_TYPED = 1, NvInfer.h NetworkDefinitionCreationFlag). No PREFER_*_PYTHON_PLUGINS: every
    plugin node carries its own `aot` attribute."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if environment.tensorrt_major(trt.__version__) >= 11 or flag is None:
        return 0
    return 1 << int(flag)


def parse_network(trt, builder, logger, model: bytes, label: str):
    """A strongly typed network parsed from a graph with our plugin nodes (registered before)."""
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model, label):
        raise K2Error(format_parser_errors(label, _parser_errors(parser)))
    return network, parser


class Builder:
    """One TensorRT builder and timing cache for all engines of a build."""

    def __init__(self, trt, spec: ProfileSpec, timing_cache: Path | None, verbose: bool = False, logger=None):
        self.trt, self.spec, self.cache_path = trt, spec, timing_cache
        self.logger = logger or trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        data = timing_cache.read_bytes() if timing_cache and timing_cache.exists() else b""
        self._cache_config = self.builder.create_builder_config()
        self.cache = self._cache_config.create_timing_cache(data)

    def build(self, kind: str, model: bytes, graph: dict, progress: BuildProgress | None = None) -> bytes:
        trt = self.trt
        label = graph["file"]
        # the network refers to constants the parser holds: keep the parser until the engine is built
        network, _parser = parse_network(trt, self.builder, self.logger, model, label)
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        check_network_inputs([(t.name, tuple(t.shape)) for t in inputs], graph, label)
        config = self.builder.create_builder_config()
        for prof in graph_profiles(self.spec, graph):
            p = self.builder.create_optimization_profile()
            for name, r in prof.shapes.items():
                p.set_shape(name, r.min, r.opt, r.max)
            config.add_optimization_profile(p)
        config.set_timing_cache(self.cache, False)
        # the monitor must outlive every TensorRT object that uses it (IProgressMonitorDoc): kept on self
        self.monitor = progress_monitor(trt, progress) if progress is not None else None
        if self.monitor is not None:
            config.progress_monitor = self.monitor
        blob = self.builder.build_serialized_network(network, config)
        if blob is None:
            raise K2Error(f"{label}: TensorRT could not build the {kind} engine (see its log above)")
        return bytes(blob)

    def save_timing_cache(self) -> None:
        if self.cache_path is not None:
            atomic_write_bytes(self.cache_path, bytes(self.cache.serialize()))
