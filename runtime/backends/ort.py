"""The ONNX Runtime backend: the lowered graphs of an export directory, one session per block kind, each layer's
weights prepared once and bound in an IOBinding. CPUExecutionProvider by default; CUDA when onnxruntime-gpu and a
GPU are present and asked for."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from k2trt.dtypes import DTYPES, FP8, torch_dtype
from k2trt.errors import K2Error, MissingDependency
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.export_manifest import (check_expert_parallel_export, check_matches, graph_file, graph_path,
                                  read_manifest)
from k2trt.graphs.fp8 import WEIGHT_DEQUANT
from k2trt.graphs.mask import MASK_NEG
from k2trt.runtime.backends.contract import (BackendLimits, Progress, WeightSource, bound_kinds,
                                            prepare_each)
from k2trt.runtime.backends.graph_weights import graph_weights, source_names

if TYPE_CHECKING:  # imported where a model proto is made: running graphs never needs onnx (~0.7 s a process)
    import onnx


STEP_SHARED_INPUTS = ("rope_cos", "rope_sin", "attention_mask")  # one tensor each per step, fed to every block


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise MissingDependency("onnxruntime is not installed (pip install 'k2trt[cpu]')") from None
    return onnxruntime


def ort_value(t: torch.Tensor):
    """A CPU torch tensor as an OrtValue sharing its memory (fp8 travels as bytes with its ONNX type)."""
    ort = _ort()
    t = t.contiguous()
    if t.dtype == torch.float8_e4m3fn:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.uint8).numpy(), DTYPES[FP8].onnx)
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def session_options(threads: int | None = None):
    """One thread policy for every session. ONNX Runtime's intra-op pool owns the cores while a session runs
    (its default size: the physical cores); between runs its threads sleep instead of spinning, so the host
    work of a step (mask, cache writes, sampling) gets the cores it needs. Spinning workers starve
    that work and make the runtime's own speed swing from run to run."""
    opts = _ort().SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def bind_weights(model: onnx.ModelProto, tensors: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """A copy of `model` whose inputs named in `tensors` are initializers holding those values, stored as the
    input's declared element type (float8 as its bytes)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    declared = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    missing = sorted(set(tensors) - set(declared))
    if missing:
        raise KeyError(f"graph {graph.name!r} has no inputs {missing}")
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.contiguous()
        graph.initializer.append(onnx.TensorProto(name=name, data_type=declared[name], dims=list(t.shape),
                                                  raw_data=raw.numpy().tobytes()))
    keep = [i for i in graph.input if i.name not in tensors]
    del graph.input[:]
    graph.input.extend(keep)
    return out


class OrtBackend:
    name = "ort"
    device = torch.device("cpu")
    activation_quant = WEIGHT_DEQUANT  # the lowered graphs compute with dequantized weights
    limits = BackendLimits()
    reads_pages = False  # its graphs take the gathered cache (the paged node lowers to a gather anyway)

    def __init__(self, export_dir: str | Path, weights: WeightSource, providers: list[str] | None = None,
                 cache_layers: bool = True, threads: int | None = None, expert_parallel: int = 1):
        ort = _ort()
        self.export_dir = Path(export_dir)
        self.manifest = read_manifest(self.export_dir)
        self.cfg = weights.config
        check_matches(self.manifest, self.cfg, str(export_dir))
        self.expert_parallel = expert_parallel
        kinds = BLOCK_KINDS + (MOE_PART_KINDS if expert_parallel > 1 else ())
        if expert_parallel > 1:
            check_expert_parallel_export(self.manifest, expert_parallel, str(export_dir))
        act = self.manifest["act_dtype"]
        if act != "float32" and (providers is None or providers == ["CPUExecutionProvider"]):
            raise K2Error(f"{export_dir}: graphs are {act}; ONNX Runtime on CPU needs float32 graphs "
                          f"(re-export with --dtype float32)")
        self.act_dtype = torch_dtype(act)
        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in ort.get_available_providers()]
        if missing:
            raise MissingDependency(f"ONNX Runtime provider(s) {', '.join(missing)} not available "
                                    f"(have {', '.join(ort.get_available_providers())})")
        opts = session_options(threads)
        self.sessions, self.entries = {}, {}
        for kind in kinds:
            path = graph_file(self.export_dir, self.manifest, f"ort/{kind}")
            self.entries[kind] = self.manifest["graphs"][f"ort/{kind}"]
            try:
                self.sessions[kind] = ort.InferenceSession(str(path), opts, providers=providers)
            except Exception as e:  # ORT raises its own exception types for every kind of bad file
                raise K2Error(f"{path}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None
        self.weights = weights
        self.cache_layers = cache_layers
        self._session_s = 0.0
        self._values: OrderedDict = OrderedDict()  # id(tensor) -> (tensor, OrtValue), see _shared_value
        self._bound: dict = {}
        self._past_memo: tuple = (None, None)  # (a step's mask, that mask without its cache part, or None)

    # ---- weights ------------------------------------------------------------------------------------
    def _prepared_weights(self, kind: str, layer: int | None) -> dict[str, torch.Tensor]:
        """The weight inputs of `kind`'s ORT graph for one layer (None: the embedding/head globals), prepared
        as the manifest says: dequantized, transposed, interleaved or cast."""
        if layer is None:  # the embedding or the head: only the tensors its graph reads
            source = self.weights.globals(source_names(self.entries[kind]))
        else:
            source = self.weights.block_weights(layer)
        return graph_weights(self.entries[kind], source, self.act_dtype)

    def _layer(self, key, kind: str, layer: int | None):
        """An IOBinding of `kind`'s session with this layer's weights bound once: each call then binds only
        the activations (ONNX Runtime would otherwise re-read every weight feed on every run)."""
        if key in self._bound:
            return self._bound[key]
        io = self.sessions[kind].io_binding()
        weights = {name: ort_value(t) for name, t in self._prepared_weights(kind, layer).items()}
        for name, value in weights.items():
            io.bind_ortvalue_input(name, value)
        bound = (io, weights, [o["name"] for o in self.entries[kind]["outputs"]])  # weights outlive the binding
        if self.cache_layers or not isinstance(key, int):
            self._bound[key] = bound
        return bound

    def prepare(self, layers: Iterable[int] | None = None, *, embedding: bool = True, head: bool = True,
                progress: Progress | None = None) -> None:
        def bind(item, kind):
            if not isinstance(item, int):
                return self._layer(item, kind, None)
            for part in bound_kinds(kind, self.expert_parallel):
                self._part(part, item)

        prepare_each(bind, self.cfg, layers, embedding, head, progress)

    def _part(self, kind: str, layer: int):
        """A layer's binding of one graph kind: the block itself (keyed by the layer, as always) or a MoE part."""
        return self._layer(layer if kind in BLOCK_KINDS else (kind, layer), kind, layer)

    def draft_runner(self, draft, target_embedding):
        """The draft's graphs of this export on ONNX Runtime, where `k2trt export --draft` put them (float32)."""
        from k2trt.runtime.backends.drafts import OrtDraftRunner, holds_draft

        if self.manifest["act_dtype"] != "float32" or not holds_draft(self.manifest, draft):
            return None
        return OrtDraftRunner(self.export_dir, self.manifest, draft, target_embedding)

    def standalone_onnx(self, kind: str, layer: int | None) -> onnx.ModelProto:
        import onnx

        model = onnx.load(str(graph_path(self.export_dir, self.entries[kind])))
        return bind_weights(model, self._prepared_weights(kind, layer))

    def session_seconds(self) -> float:
        return self._session_s

    # ---- running ------------------------------------------------------------------------------------
    def _shared_value(self, t: torch.Tensor):
        """The OrtValue of a tensor that feeds every block of a step (STEP_SHARED_INPUTS), made once per step.
        The memo holds the tensor, so a live entry's memory cannot be reused by another tensor; it holds only
        these few, never a layer's hidden states or a cache view (which would keep a resized cache alive)."""
        hit = self._values.get(id(t))
        if hit is not None and hit[0] is t:
            self._values.move_to_end(id(t))
            return hit[1]
        value = ort_value(t)
        self._values[id(t)] = (t, value)
        if len(self._values) > 2 * (len(STEP_SHARED_INPUTS) + 1):  # two steps' worth, a trimmed mask included
            self._values.popitem(last=False)
        return value

    def _run(self, kind: str, feeds: dict, bound) -> list[torch.Tensor]:
        io, _, outputs = bound
        values = [self._shared_value(t) if name in STEP_SHARED_INPUTS else ort_value(t) for name, t in feeds.items()]
        for name, value in zip(feeds, values):  # `values` keeps every OrtValue alive until the run returns
            io.bind_ortvalue_input(name, value)
        io.clear_binding_outputs()  # shapes change from step to step: let ONNX Runtime allocate each run
        for name in outputs:
            io.bind_output(name, "cpu")
        t0 = time.perf_counter()
        self.sessions[kind].run_with_iobinding(io)
        self._session_s += time.perf_counter() - t0
        # OrtValue.numpy() views memory the OrtValue owns without keeping it alive: copy before it is freed.
        # (Binding fresh torch tensors as outputs instead was measured slower for the blocks.)
        return [torch.from_numpy(np.array(o.numpy(), copy=True)) for o in io.get_outputs()]

    def embed(self, input_ids):
        return self._run("embedding", {"input_ids": input_ids}, self._layer("embedding", "embedding", None))[0]

    def _without_unseen_past(self, mask: torch.Tensor, latent_cache: torch.Tensor):
        """A step none of whose queries sees any of the P cache slots (every prompt starts fresh) runs on no
        slots: a masked key weighs exactly 0, so the result is the same, without attending over P masked slots
        (for a fresh prompt P >= T: at least half the attention). Decided once per step's mask."""
        p = latent_cache.shape[1]
        if p == 0:
            return mask, latent_cache
        if self._past_memo[0] is not mask:
            unseen = bool(mask.numpy()[..., :p].max() <= MASK_NEG)  # NumPy: no torch threads between runs
            self._past_memo = (mask, mask[..., p:].contiguous() if unseen else None)
        trimmed = self._past_memo[1]
        return (mask, latent_cache) if trimmed is None else (trimmed, latent_cache[:, :0])

    def block(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        kind = self.cfg.layer_kind(layer)
        mask, latent_cache = self._without_unseen_past(mask, latent_cache)
        h, new = self._run(kind, {"hidden_states": hidden, "rope_cos": rope_cos, "rope_sin": rope_sin,
                                  "attention_mask": mask, "latent_cache": latent_cache},
                           self._layer(layer, kind, layer))
        return h, new

    def head(self, hidden):
        return self._run("head", {"hidden_states": hidden}, self._layer("head", "head", None))[0]

    # ---- a MoE block's parts (expert parallelism) -----------------------------------------------------------
    def moe_front(self, layer, hidden, rope_cos, rope_sin, mask, latent_cache):
        mask, latent_cache = self._without_unseen_past(mask, latent_cache)
        return tuple(self._run("moe_front", {"hidden_states": hidden, "rope_cos": rope_cos, "rope_sin": rope_sin,
                                             "attention_mask": mask, "latent_cache": latent_cache},
                               self._part("moe_front", layer)))

    def moe_experts(self, layer, rows, expert_ids, decode: bool = False):
        return self._run("moe_experts", {"expert_rows": rows, "expert_ids": expert_ids},
                         self._part("moe_experts", layer))[0]

    def moe_combine(self, layer, pair_out, topk_weights, shared_out, residual):
        return self._run("moe_combine", {"pair_out": pair_out, "topk_weights": topk_weights,
                                         "shared_out": shared_out, "residual": residual},
                         self._layer("moe_combine", "moe_combine", None))[0]
