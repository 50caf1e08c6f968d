"""A stand-in for TensorRT's runtime side — IRuntime, ICudaEngine, IExecutionContext — as the runtime's TensorRT
backend drives them (runtime/backends/tensorrt.py: Engine, Context), enforcing the rules TensorRT states:

  * IExecutionContext::setOptimizationProfileAsync: an index among the engine's profiles (NvInferRuntime.h);
  * setInputShape: "false if the provided name does not map to an input tensor"; "each dimension must agree with
    the network dimension unless the latter was -1" (NvInferRuntime.h); and inside the selected profile's
    [min, max] — IOptimizationProfile: "A runtime error will be raised if the input tensor dimensions fall outside
    the valid range for this profile";
  * setTensorAddress: the name of an I/O tensor of the engine (weights are network inputs here);
  * getTensorShape of an output: its dimensions from the named dims the input shapes fix (the builder's shape
    inference, here the manifest's symbolic shapes);
  * enqueueV3: every input has its shape (where dynamic) and address, every output an address.

Each engine is the network its manifest entry describes (the graph's inputs, outputs and profiles: what `k2trt
build` parsed and recorded). It computes nothing: enqueue zero-fills the outputs at their bound addresses, so a
generation runs through every binding with well-defined (meaningless) values. Kernels are checked elsewhere
(tests/trt_standin.py and the AOT tests); this checks the glue between the runtime and the engines.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from k2trt.dtypes import torch_dtype
from k2trt.runtime.tensorrt.profiles import Profile, eval_dim


class StandinStream:
    cuda_stream = 0


class StandinContext:
    def __init__(self, engine: "StandinEngine"):
        self.engine = engine
        self.profile = 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.enqueued = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < len(self.engine.profiles):
            return False
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape: tuple) -> bool:
        declared = self.engine.inputs.get(name)
        if declared is None:
            return False  # not an input tensor
        if len(shape) != len(declared) or any(isinstance(d, int) and d != s for d, s in zip(declared, shape)):
            return False  # must agree with the network dimension unless that was -1
        r = self.engine.profiles[self.profile].shapes.get(name)
        if r is not None and not all(lo <= s <= hi for lo, s, hi in zip(r.min, shape, r.max)):
            raise RuntimeError(f"{self.engine.name}: {name} shape {tuple(shape)} is outside profile "
                               f"{self.profile}'s [{r.min}, {r.max}]")
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if name not in self.engine.inputs and name not in self.engine.outputs:
            return False
        self.addresses[name] = ptr
        return True

    def _dims(self) -> dict[str, int]:
        """The named dims the input shapes fix (each name one value, as the builder's shape inference requires)."""
        dims: dict[str, int] = {}
        for name, shape in self.shapes.items():
            for d, s in zip(self.engine.inputs[name], shape):
                if isinstance(d, str) and d.isidentifier():
                    if dims.setdefault(d, s) != s:
                        raise RuntimeError(f"{self.engine.name}: dim {d} is {dims[d]} and {s}")
        for name, shape in self.shapes.items():  # expressions over them ("P+T") must hold too
            for d, s in zip(self.engine.inputs[name], shape):
                if isinstance(d, str) and not d.isidentifier() and eval_dim(d, dims) != s:
                    raise RuntimeError(f"{self.engine.name}: {name} has {s} where {d} = {eval_dim(d, dims)}")
        return dims

    def get_tensor_shape(self, name: str) -> tuple:
        shape = self.engine.outputs.get(name) or self.engine.inputs[name]
        dims = self._dims()
        return tuple(eval_dim(d, dims) for d in shape)

    def execute_async_v3(self, stream: int) -> bool:
        e = self.engine
        for name, shape in e.inputs.items():
            if name not in self.addresses:
                return False
            if any(not isinstance(d, int) for d in shape) and name not in self.shapes:
                return False
        if any(name not in self.addresses for name in e.outputs):
            return False
        for name in e.outputs:
            n = 1
            for s in self.get_tensor_shape(name):
                n *= s
            ctypes.memset(self.addresses[name], 0, n * e.dtypes[name].itemsize)
        self.enqueued += 1
        return True


class StandinEngine:
    def __init__(self, name: str, entry: dict):
        self.name = name
        self.inputs = {i["name"]: i["shape"] for i in entry["inputs"]}
        self.outputs = {o["name"]: o["shape"] for o in entry["outputs"]}
        self.dtypes = {i["name"]: torch_dtype(i["dtype"]) for i in entry["inputs"] + entry["outputs"]}
        self.profiles = [Profile.from_dict(p) for p in entry["profiles"]]
        self.contexts: list[StandinContext] = []

    def create_execution_context(self, *strategy) -> StandinContext:
        ctx = StandinContext(self)
        self.contexts.append(ctx)
        return ctx


class StandinRuntime:
    """IRuntime: deserializes an engine file written by `standin_engine_dir` (its bytes name its manifest entry)."""

    def __init__(self, entries: dict[str, dict]):
        self.entries = entries

    def deserialize_cuda_engine(self, blob: bytes) -> StandinEngine | None:
        name = blob.decode()
        return StandinEngine(name, self.entries[name]) if name in self.entries else None


def standin_backend(export_dir: Path, engine_dir: Path, weights, spec, names) -> tuple:
    """A TrtBackend over stand-in engines for `names` of an export (entries as `k2trt build` records them), on the
    CPU: its own Engine and Context classes drive the stand-in contexts; only its CUDA stream ordering (`_run`'s
    waits) is left out. -> (backend, {name: StandinEngine})."""
    from k2trt.export_manifest import read_manifest
    from k2trt.runtime.backends.contract import BackendLimits
    from k2trt.runtime.backends.tensorrt import Engine, OutputArena, TrtBackend
    from k2trt.runtime.tensorrt import engine_manifest as EM
    from k2trt.runtime.tensorrt.profiles import graph_profiles
    from k2trt.graphs.blocks import decompress_from

    export = read_manifest(export_dir)
    entries = {}
    engine_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        graph = export["graphs"][f"trt/{name}"]
        path = engine_dir / f"{name}.engine"
        path.write_bytes(name.encode())
        entries[name] = EM.engine_entry(name.split(".")[0], graph, graph_profiles(spec, graph), path.name,
                                        EM.sha256_file(path), {})
    runtime = StandinRuntime(entries)
    be = TrtBackend.__new__(TrtBackend)
    be.cfg, be.weights, be.spec, be.expert_parallel = weights.config, weights, spec, 1
    be.manifest = {"engines": entries, **({"draft": export["draft"]} if "draft" in export else {})}
    be.limits = BackendLimits(max_context=spec.max_seq, max_tokens_per_step=spec.max_prefill,
                              max_batch=spec.max_batch, max_cache_pages=spec.pool_pages)
    be.decompress_from = decompress_from(be.cfg)
    be.activation_quant = int(export["activation_quant"])
    be.act_dtype = torch_dtype(export["act_dtype"])
    be.device = torch.device("cpu")
    be.engines = {name: Engine(runtime, engine_dir / e["file"], e) for name, e in entries.items()}
    be.stream, be._bound, be.arena, be.graphs = StandinStream(), {}, OutputArena(be.device), None

    def run(kind, t, inputs, weights_, outputs):  # TrtBackend._run without the CUDA stream waits
        be.engines[kind].bind(t, inputs, weights_, outputs, be.stream)
        be.engines[kind].enqueue(be.stream)

    be._run = run
    return be, {name: be.engines[name].engine for name in names}
