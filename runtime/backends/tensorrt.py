"""The TensorRT backend: the engines of an engine directory behind the Backend interface (runtime/backends/contract.py).

  * each engine is deserialized once, with one execution context (and one per captured CUDA graph); the profile is
    chosen per call by T
    (decode profile when T == 1, prefill otherwise) and switched only when it changes;
  * each layer's weights are uploaded once, on first use, as CUDA tensors in the graph's dtypes (bf16 checkpoint
    tensors in the activation dtype, FP8 as float8_e4m3fn, experts stacked) and bound by address on every call —
    one engine serves every layer of its kind;
  * outputs go to preallocated buffers that grow to the largest shape seen; hidden states alternate between two
    buffers so a block never writes the buffer it reads. A returned tensor stays valid until the same output is
    written again (the next call of that kind; for hidden states, the call after next);
  * everything is enqueued on one CUDA stream, ordered after the caller's stream and before its next work.

Optional CUDA graphs for decode blocks (`cuda_graphs=True`, off by default): see DecodeGraphs below.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable

import torch

from k2trt.errors import K2Error
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.export_manifest import check_expert_parallel_export, read_manifest
from k2trt.dtypes import torch_dtype
from k2trt.runtime.backends.contract import (BackendLimits, Progress, WeightSource, bound_kinds,
                                            prepare_each)
from k2trt.runtime.backends.graph_weights import graph_weights, source_names
from k2trt.runtime.tensorrt import engine_manifest as EM
from k2trt.runtime.tensorrt import environment
from k2trt.export.trt_form import engine_name, engine_names
from k2trt.graphs.blocks import PagedCache, decompress_from
from k2trt.runtime.aot.mla import PAGE_TOKENS
from k2trt.runtime.tensorrt.profiles import DECODE, check_call_shape, check_table_pages, eval_dim, profile_index



def output_shapes(entry: dict, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Each output's concrete shape from the manifest's symbolic one."""
    return {o["name"]: tuple(eval_dim(d, dims) for d in o["shape"]) for o in entry["outputs"]}


def upload_weights(entry: dict, source: dict, act_dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The graph's weight inputs from a weight source's tensors, prepared as the manifest says, on the device in
    the graph dtypes (moved first: casting and dequantizing on the GPU is faster for big tensors)."""
    declared = {i["name"]: i for i in entry["inputs"]}
    out = {}
    for name, t in graph_weights(entry, source, act_dtype, device).items():
        want = declared[name]
        if list(t.shape) != list(want["shape"]):
            raise K2Error(f"weight {name!r}: shape {list(t.shape)}, the engine expects {want['shape']}")
        if t.dtype != torch_dtype(want["dtype"]):
            raise K2Error(f"weight {name!r}: {t.dtype}, the engine expects {want['dtype']}")
        out[name] = aligned(t.contiguous())  # bound by address: a view into a mapped file may sit off-boundary
    return out


class OutputArena:
    """Growable per-name buffers: one allocation reused by every call that fits."""

    def __init__(self, device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, device=self.device)
            self.buffers[key] = buf
        return buf[:n].view(shape)


# NvInferRuntime.h IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment."
TENSOR_ALIGNMENT = 256


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy of it where its address breaks TensorRT's alignment (a view at an odd offset)."""
    return x if x.data_ptr() % TENSOR_ALIGNMENT == 0 else x.clone(memory_format=torch.contiguous_format)


class Context:
    """One TensorRT execution context: its optimization profile, its bindings, its enqueue. Every call into it is
    checked: set_optimization_profile_async, set_input_shape and set_tensor_address return False on a refusal
    (NvInferRuntime.h), which would otherwise surface as a wrong result or a failed enqueue later."""

    def __init__(self, context, entry: dict, dtypes: dict):
        self.context, self.entry, self.dtypes = context, entry, dtypes
        self.profile = None

    def _check(self, ok, what: str) -> None:
        if not ok:
            raise K2Error(f"{self.entry['kind']}: TensorRT refused {what} (see its log above)")

    def _address(self, name: str, t: torch.Tensor) -> None:
        ptr = t.data_ptr()
        if ptr % TENSOR_ALIGNMENT:
            raise K2Error(f"{self.entry['kind']}: {name} is at an address {ptr % TENSOR_ALIGNMENT} bytes past a "
                          f"{TENSOR_ALIGNMENT}-byte boundary; TensorRT binds {TENSOR_ALIGNMENT}-byte aligned tensors")
        self._check(self.context.set_tensor_address(name, ptr), f"the address of {name}")

    def bind(self, t: int, inputs: dict, weights: dict, outputs: dict, stream: torch.cuda.Stream) -> None:
        ctx = self.context
        p = profile_index(t)
        if p != self.profile:
            self._check(ctx.set_optimization_profile_async(p, stream.cuda_stream), f"optimization profile {p}")
            self.profile = p
        for name, x in inputs.items():
            if x.dtype != self.dtypes[name]:
                raise K2Error(f"{self.entry['kind']}: input {name} is {x.dtype}, the engine takes {self.dtypes[name]}")
            self._check(ctx.set_input_shape(name, tuple(x.shape)), f"shape {tuple(x.shape)} for {name}")
            self._address(name, x)
        for name, w in weights.items():
            self._address(name, w)
        for name, y in outputs.items():
            if tuple(ctx.get_tensor_shape(name)) != tuple(y.shape):
                raise K2Error(f"{self.entry['kind']}: output {name} is {tuple(ctx.get_tensor_shape(name))} in "
                              f"TensorRT, {tuple(y.shape)} by the manifest")
            self._address(name, y)

    def enqueue(self, stream: torch.cuda.Stream) -> None:
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise K2Error(f"{self.entry['kind']}: TensorRT failed to enqueue the engine (see its log above)")


class Engine:
    """One deserialized engine and its execution context (plus one per captured CUDA graph, see DecodeGraphs)."""

    def __init__(self, runtime, path: Path, entry: dict):
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise K2Error(f"{path}: TensorRT could not deserialize the engine (see its log above)")
        self.engine, self.entry = engine, entry
        self.dtypes = {i["name"]: torch_dtype(i["dtype"]) for i in entry["inputs"] + entry["outputs"]}
        self.main = Context(engine.create_execution_context(), entry, self.dtypes)

    def user_managed_context(self, trt, memory: torch.Tensor) -> Context:
        """A new context whose activation memory is `memory` (ExecutionContextAllocationStrategy.USER_MANAGED)."""
        ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if ctx is None:
            raise K2Error(f"{self.entry['kind']}: TensorRT could not create an execution context")
        ctx.set_device_memory(memory.data_ptr(), memory.numel())
        return Context(ctx, self.entry, self.dtypes)

    def decode_memory_bytes(self) -> int:
        return int(self.engine.get_device_memory_size_for_profile_v2(DECODE))

    def bind(self, t: int, inputs: dict, weights: dict, outputs: dict, stream: torch.cuda.Stream) -> None:
        self.main.bind(t, inputs, weights, outputs, stream)

    def enqueue(self, stream: torch.cuda.Stream) -> None:
        self.main.enqueue(stream)


class TrtBackend:
    name = "trt"
    # the attention kinds' engines read the layer's pool in place (the MLA plugins): no gathered cache, no mask;
    # a step of T >= blocks.decompress_from new positions runs the kind's prefill form (export/trt_form.py)
    reads_pages = True

    def __init__(self, engine_dir: str | Path, weights: WeightSource, export_dir: str | Path | None = None,
                 cuda_graphs: bool = False, device: int = 0, verbose: bool = False, expert_parallel: int = 1):
        trt = environment.import_tensorrt()
        environment.require_cuda()
        from k2trt.runtime.tensorrt.plugins import register_plugins

        engine_dir = Path(engine_dir)
        export = read_manifest(Path(export_dir)) if export_dir is not None else None
        self.manifest = EM.load_engine_manifest(engine_dir, export)
        self.cfg = weights.config
        if self.manifest["config_fingerprint"] != self.cfg.fingerprint():
            raise K2Error(f"{engine_dir}: engines were built for config {self.manifest['config_fingerprint']}, "
                          f"the checkpoint is {self.cfg.fingerprint()}")
        self.expert_parallel = expert_parallel
        if expert_parallel > 1:  # the MoE layers run as their parts, built from an --expert-parallel E export
            check_expert_parallel_export(self.manifest, expert_parallel, str(engine_dir))
        needed = engine_names(BLOCK_KINDS + (MOE_PART_KINDS if expert_parallel > 1 else ()))
        missing = [k for k in needed if k not in self.manifest["engines"]]
        if missing:
            raise K2Error(f"{engine_dir}: no engine for {', '.join(missing)} (built with --kinds?); "
                          "build all of them to generate")
        self.spec = EM.profile_spec_of(self.manifest)
        # what the engines' profiles allow: the generator refuses longer requests and chunks prefill to fit
        self.limits = BackendLimits(max_context=self.spec.max_seq, max_tokens_per_step=self.spec.max_prefill,
                                    max_batch=self.spec.max_batch, max_cache_pages=self.spec.pool_pages)
        self.decompress_from = decompress_from(self.cfg)
        self.activation_quant = int(self.manifest["activation_quant"])
        self.act_dtype = torch_dtype(self.manifest["act_dtype"])
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        if any(mode == "jit" for e in self.manifest["engines"].values() for mode in e["plugins"].values()):
            register_plugins()  # JIT plugins run Python at enqueue: their definitions must exist before deserializing
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engines = {kind: Engine(self.runtime, engine_dir / e["file"], e)
                        for kind, e in self.manifest["engines"].items()}
        self.stream = torch.cuda.Stream(self.device)
        self.weights = weights
        self._bound: dict = {}
        self.arena = OutputArena(self.device)
        self.graphs = DecodeGraphs(self) if cuda_graphs else None

    # ---- weights ------------------------------------------------------------------------------------
    def layer_weights(self, key, kind: str) -> dict[str, torch.Tensor]:
        """One engine's weights for a layer (key: the layer; (part, layer) for a MoE part), or for the embedding,
        the head or the weightless combine (key: the kind)."""
        if key not in self._bound:
            layer = key if isinstance(key, int) else key[1] if isinstance(key, tuple) else None
            if layer is not None:
                source = self.weights.block_weights(layer)
            else:  # the embedding or the head: only the tensors its engine reads
                source = self.weights.globals(source_names(self.engines[kind].entry))
            self._bound[key] = upload_weights(self.engines[kind].entry, source, self.act_dtype, self.device)
        return self._bound[key]

    def prepare(self, layers: Iterable[int] | None = None, *, embedding: bool = True, head: bool = True,
                progress: Progress | None = None) -> None:
        def bind(item, kind):
            for part in bound_kinds(kind, self.expert_parallel) if isinstance(item, int) else (kind,):
                self.layer_weights(item if part == kind else (part, item), part)

        prepare_each(bind, self.cfg, layers, embedding, head, progress)

    def session_seconds(self) -> None:
        return None  # enqueues are asynchronous: the time inside TensorRT is not separable on the host

    def draft_runner(self, draft, target_embedding):
        """The draft's engines, where `k2trt build` built them from an export with --draft."""
        from k2trt.runtime.backends.drafts import draft_weights, holds_draft
        from k2trt.runtime.backends.tensorrt_draft import TrtDraftRunner

        if not holds_draft(self.manifest, draft):
            return None
        return TrtDraftRunner(self, draft, draft_weights(draft, target_embedding), self.cfg)

    def standalone_onnx(self, kind: str, layer: int | None) -> None:
        return None

    # ---- running ------------------------------------------------------------------------------------
    def _outputs(self, kind: str, dims: dict, avoid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        engine = self.engines[kind]
        outs = {}
        for name, shape in output_shapes(engine.entry, dims).items():
            key = f"{kind}/{name}"
            if name == "hidden_states_out":  # ping-pong: never the buffer the block reads
                key = "hidden/a"
                buf = self.arena.get(key, shape, engine.dtypes[name])
                if avoid is not None and buf.data_ptr() == avoid.data_ptr():
                    key = "hidden/b"
            outs[name] = self.arena.get(key, shape, engine.dtypes[name])
        return outs

    def _run(self, kind: str, t: int, inputs: dict, weights: dict, outputs: dict) -> None:
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)  # inputs were written on the caller's stream
        engine = self.engines[kind]
        engine.bind(t, inputs, weights, outputs, self.stream)
        engine.enqueue(self.stream)
        caller.wait_stream(self.stream)  # the caller's next work (and frees) come after ours

    def _on_device(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return aligned(x.to(self.device, dtype or x.dtype).contiguous())

    def _attention_inputs(self, hidden, rope_cos, rope_sin, cache: PagedCache) -> tuple[dict, dict]:
        """A block's (or MoE front's) activation inputs on the device, the layer's pool read in place (never
        copied), and the dims of its outputs."""
        if not isinstance(cache, PagedCache):
            raise K2Error("the TensorRT engines read the cache's pages in place: give a PagedCache "
                          "(PagedLatentCache.paged), not a gathered cache")
        pool = cache.pool
        if pool.device != self.device or pool.dtype != self.act_dtype or not pool.is_contiguous():
            raise K2Error(f"the latent pool must be a contiguous {self.act_dtype} tensor on {self.device} "
                          "(it is read in place)")
        if cache.page_tokens != PAGE_TOKENS:
            raise K2Error(f"pages of {cache.page_tokens} positions; the engines were exported for {PAGE_TOKENS}")
        rows_max = self.spec.pool_pages * PAGE_TOKENS
        if pool.shape[0] > rows_max:
            raise K2Error(f"the latent pool holds {pool.shape[0]} positions a layer, the engines at most {rows_max} "
                          "(rebuild with a larger --max-batch or --max-seq, or give the cache fewer pages)")
        b, t = hidden.shape[:2]
        inputs = {"hidden_states": self._on_device(hidden, self.act_dtype),
                  "rope_cos": self._on_device(rope_cos, self.act_dtype),
                  "rope_sin": self._on_device(rope_sin, self.act_dtype),
                  "kv_pool": pool,
                  "page_table": self._on_device(cache.page_table, torch.int32),
                  "ctx_lens": self._on_device(cache.ctx_lens, torch.int32),
                  "n_new": self._on_device(cache.n_new, torch.int32)}
        pages = inputs["page_table"].shape[1]
        check_call_shape(self.spec, b, t)
        check_table_pages(self.spec, pages)
        return inputs, {"B": b, "T": t, "pages": pages, "rows": pool.shape[0]}

    def _form(self, kind: str, t: int) -> str:
        """The engine of an attention kind for a step of T new positions: absorbed below decompress_from, as the
        torch reference and the ONNX Runtime graphs choose."""
        return engine_name(kind, "prefill" if t >= self.decompress_from else "decode")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        check_call_shape(self.spec, b, t)
        w = self.layer_weights("embedding", "embedding")
        ids = self._on_device(input_ids, torch.int64)
        out = self._outputs("embedding", {"B": b, "T": t})
        self._run("embedding", t, {"input_ids": ids}, w, out)
        return out["hidden_states"]

    def block(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        """mask: None (the pages say what each query sees); latent_cache: the layer's PagedCache."""
        kind = self.cfg.layer_kind(layer)
        inputs, dims = self._attention_inputs(hidden, rope_cos, rope_sin, latent_cache)
        t = dims["T"]
        w = self.layer_weights(layer, kind)  # one upload serves both forms: they take the same weights
        if self.graphs is not None and t == 1:
            replayed = self.graphs.run(layer, kind, inputs, w)
            if replayed is not None:
                return replayed
        engine = self._form(kind, t)
        out = self._outputs(engine, dims, avoid=inputs["hidden_states"])
        self._run(engine, t, inputs, w, out)
        return out["hidden_states_out"], out["latent_new"]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t = hidden.shape[:2]
        check_call_shape(self.spec, b, t)
        w = self.layer_weights("head", "head")
        out = self._outputs("head", {"B": b, "T": t})
        self._run("head", t, {"hidden_states": self._on_device(hidden, self.act_dtype)}, w, out)
        return out["logits"]

    # ---- a MoE block's parts (expert parallelism) -----------------------------------------------------------
    def moe_front(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        inputs, dims = self._attention_inputs(hidden, rope_cos, rope_sin, latent_cache)
        engine = self._form("moe_front", dims["T"])
        out = self._outputs(engine, dims)
        self._run(engine, dims["T"], inputs, self.layer_weights(("moe_front", layer), "moe_front"), out)
        return tuple(out[o["name"]] for o in self.engines[engine].entry["outputs"])

    def moe_experts(self, layer, rows, expert_ids, decode: bool = False):
        """Calls of at most the profile's rows (a prefill dispatch may bring more: rows are independent)."""
        entry = self.engines["moe_experts"].entry
        profile = "decode" if decode else "prefill"
        limit = self.spec.row_range(profile, entry["dispatch"]["top_k"], entry["dispatch"]["ranks"])[2]
        t = 1 if decode else 2  # the profile a call of T new positions selects (profiles.profile_index)
        w = self.layer_weights(("moe_experts", layer), "moe_experts")
        parts = []
        for start in range(0, rows.shape[0], limit):
            chunk = rows[start:start + limit]
            out = self._outputs("moe_experts", {"R": chunk.shape[0]})
            self._run("moe_experts", t, {"expert_rows": self._on_device(chunk, self.act_dtype),
                                         "expert_ids": self._on_device(expert_ids[start:start + limit],
                                                                       torch.int32)}, w, out)
            parts.append(out["expert_out"] if rows.shape[0] <= limit else out["expert_out"].clone())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def moe_combine(self, layer, pair_out, topk_weights, shared_out, residual):
        b, t = residual.shape[:2]
        inputs = {"pair_out": self._on_device(pair_out, self.act_dtype),
                  "topk_weights": self._on_device(topk_weights, torch.float32),
                  "shared_out": shared_out, "residual": residual}
        out = self._outputs("moe_combine", {"B": b, "T": t})
        self._run("moe_combine", t, inputs, self.layer_weights("moe_combine", "moe_combine"), out)
        return out["hidden_states_out"]


class DecodeGraphs:
    """CUDA graphs of decode-step blocks (T == 1), one per layer, replayed instead of re-enqueued — as trtexec
    captures them (samples/common/sampleInference.cpp, createEnqueueFunction with --useCudaGraph):

      * every graph has an execution context of its own, bound once before its capture and never again, with its
        own activation memory (USER_MANAGED, set_device_memory of get_device_memory_size_for_profile_v2(decode)):
        trtexec gives each graph context its own memory, and nothing in NvInferRuntime.h says replays of several
        contexts may share one block (setDeviceMemoryV2 forbids only use by a context "running in parallel");
        the cost is one decode activation block per layer captured (`memory_bytes`);
      * one ordinary enqueue and a stream synchronize first, so TensorRT's deferred initialization is not captured,
        then capture in cudaStreamCaptureModeThreadLocal (sampleDevice.h TrtCudaGraph::beginCapture), so other
        threads' CUDA calls (the server's, torch's) neither break nor are broken by the capture;
      * a capture that fails — TensorRT's enqueue returns False while capturing when the engine holds something
        capture does not allow — falls back to plain enqueues, with one warning line, for the rest of the run.

    Conditions (why this is off by default):
      * a graph bakes in every address and shape: the batch B, the page tables' width and each layer's pool must
        be the ones it was captured with — a new pool recaptures that layer, a new B or width drops every graph
        (the width takes four sizes an octave as sequences grow: cache.bucket); the pools live as long as the
        cache, so their addresses hold between steps;
      * inputs — hidden states, rope, page tables, lengths — are copied into static buffers before replay (a few
        KiB per layer in decode);
      * JIT plugins' Python runs only during capture, so their kernels must depend on shapes alone: no host sync, no
        data-dependent launch (true of runtime/kernels), and their allocations come from the capture's pool;
        AOT plugins (the default) are plain kernels in TensorRT's own launch sequence.
    Unverified without a GPU and TensorRT; compare its output with cuda_graphs=False before relying on it.
    """

    def __init__(self, backend: TrtBackend, warn=None):
        self.backend = backend
        self.warn = warn or (lambda message: warnings.warn(message, RuntimeWarning, stacklevel=3))
        self.key: tuple | None = None  # (B, table pages, pool rows) the graphs are for
        self.static: dict[str, torch.Tensor] = {}
        self.per_layer: dict[int, tuple] = {}  # layer -> (pool data_ptr, context, graph, outputs, memory)
        self.pool = None
        self.failed: str | None = None  # why capture failed: every decode block then runs plainly

    @property
    def memory_bytes(self) -> int:
        """Activation memory held by the captured contexts (one block each)."""
        return sum(c[4].numel() for c in self.per_layer.values())

    def _reset(self, key: tuple) -> None:
        be = self.backend
        be.stream.synchronize()  # graphs and contexts about to be dropped have finished their replays
        self.key, self.per_layer, self.pool = key, {}, torch.cuda.graph_pool_handle()
        b, pages = key[0], key[1]
        cfg = be.cfg
        half = cfg.qk_rope_head_dim // 2
        mk = lambda *s, dtype=be.act_dtype: torch.zeros(*s, dtype=dtype, device=be.device)  # noqa: E731
        self.static = {"hidden_states": mk(b, 1, cfg.hidden_size), "rope_cos": mk(b, 1, half),
                       "rope_sin": mk(b, 1, half), "page_table": mk(b, pages, dtype=torch.int32),
                       "ctx_lens": mk(b, dtype=torch.int32), "n_new": mk(b, dtype=torch.int32)}

    def run(self, layer: int, kind: str, inputs: dict, weights: dict):
        """The decode block through its graph; None where graphs are off (capture failed): run it plainly."""
        if self.failed is not None:
            return None
        be = self.backend
        pool = inputs["kv_pool"]
        key = (inputs["hidden_states"].shape[0], inputs["page_table"].shape[1], pool.shape[0])
        if self.key != key:
            self._reset(key)
        stream = be.stream
        stream.wait_stream(torch.cuda.current_stream(be.device))
        with torch.cuda.stream(stream):
            for name, buf in self.static.items():
                buf.copy_(inputs[name])
        captured = self.per_layer.get(layer)
        if captured is None or captured[0] != pool.data_ptr():
            try:
                captured = self._capture(layer, kind, pool, weights)
            except Exception as e:  # noqa: BLE001 - any failed capture: plain enqueues from now on
                self._give_up(e)
                return None
            self.per_layer[layer] = captured
        else:
            with torch.cuda.stream(stream):
                captured[2].replay()
        torch.cuda.current_stream(be.device).wait_stream(stream)
        outs = captured[3]
        return outs["hidden_states_out"], outs["latent_new"]

    def _give_up(self, error: Exception) -> None:
        self.backend.stream.synchronize()
        self.per_layer, self.static, self.pool = {}, {}, None
        self.failed = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.warn(f"TensorRT: CUDA graph capture failed ({self.failed}); decode runs without CUDA graphs")

    def _capture(self, layer: int, kind: str, pool: torch.Tensor, weights: dict) -> tuple:
        be = self.backend
        engine = be.engines[kind]  # T = 1: the decode form
        b, pages, rows = self.key
        outs = {name: torch.empty(shape, dtype=engine.dtypes[name], device=be.device) for name, shape in
                output_shapes(engine.entry, {"B": b, "T": 1, "pages": pages, "rows": rows}).items()}
        memory = torch.empty(max(engine.decode_memory_bytes(), 1), dtype=torch.uint8, device=be.device)
        ctx = engine.user_managed_context(be.trt, memory)
        ctx.bind(1, {**self.static, "kv_pool": pool}, weights, outs, be.stream)
        ctx.enqueue(be.stream)  # this step's result, and TensorRT's deferred work done before capture
        be.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=be.stream, capture_error_mode="thread_local"):
            ctx.enqueue(be.stream)
        return pool.data_ptr(), ctx, graph, outs, memory
