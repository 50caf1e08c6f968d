"""Polygraphy glue for `k2trt compare`, kept small so the polygraphy CLI and scripts can use the same pieces.

* `ort_session(model, providers)` — the session factory for polygraphy's `OnnxrtRunner`: the lowered graphs use
  only built-in ONNX Runtime ops, so it just builds the session with the chosen providers. The graphs it gets are
  a backend's `standalone_onnx` (the layer's prepared weights stored in the graph): every remaining input is
  float32/int64, so the saved inputs.json is small and plain `polygraphy run <dir>/model.onnx --onnxrt
  --load-inputs ...` works (neither polygraphy nor ONNX Runtime's numpy API can feed a float8 array).
* `BackendRunner` — a polygraphy runner over any runtime Backend's embed/block/head (used for TensorRT, whose
  engines take float8 weight inputs that polygraphy's TrtRunner cannot bind either).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import numpy as np
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType
from polygraphy.logger import G_LOGGER

from k2trt.config import BLOCK_ACTIVATIONS
from k2trt.graphs.blocks import PagedCache
from k2trt.runtime.cache.pages import PAGE_TOKENS
from k2trt.export.block_graphs import PAGED_INPUTS

# Plain log lines: polygraphy otherwise prints a hint about the optional `colored` package to stdout.
G_LOGGER.colors = False


def ort_session(model, providers: list[str] | None = None, threads: int | None = None):
    """An ONNX Runtime session for `model` (a path or serialized bytes): the OnnxrtRunner session factory.
    Use as `OnnxrtRunner(functools.partial(ort_session, path, providers))`."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), opts,
                                providers=providers or ["CPUExecutionProvider"])


@contextlib.contextmanager
def quiet():
    """Polygraphy's own log lines off (a failure it detects still raises): `k2trt compare` prints one table."""
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        yield


class BackendRunner(BaseRunner):
    """One block of a runtime Backend as a polygraphy runner. Feeds are float32/int64 numpy arrays named as in
    BLOCK_ACTIVATIONS; they are moved to the backend's device and activation dtype (the mask stays float32), and the
    outputs come back as float32 numpy."""

    def __init__(self, backend, kind: str, layer: int | None = None, name: str | None = None):
        super().__init__(name=name or backend.name, prefix="k2trt-backend-runner")
        self.backend, self.kind, self.layer = backend, kind, layer
        self.inputs, self.outputs = BLOCK_ACTIVATIONS[kind]
        # a backend that reads pages (the TensorRT engines) takes the pool, page tables and lengths (golden.py
        # records them for it) in place of the gathered cache and its mask
        self.paged = backend.reads_pages and "latent_cache" in self.inputs
        if self.paged:
            self.inputs = [n for n in self.inputs if n not in ("attention_mask", "latent_cache")] + list(PAGED_INPUTS)

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for n in self.inputs:
            rank = {"input_ids": 2, "kv_pool": 2, "page_table": 2, "ctx_lens": 1, "n_new": 1}.get(n, 3)
            dtype = DataType.INT64 if n == "input_ids" else DataType.INT32 if n in PAGED_INPUTS[1:] \
                else DataType.FLOAT32
            meta.add(n, dtype, [-1] * rank)
        return meta

    def infer_impl(self, feed_dict):
        b = self.backend
        start = time.perf_counter()
        args = []
        for n in self.inputs:
            t = torch.from_numpy(np.ascontiguousarray(feed_dict[n])).to(b.device)
            keep = t.dtype in (torch.int64, torch.int32) or n == "attention_mask"
            args.append(t if keep else t.to(b.act_dtype))
        if self.paged:  # (hidden, cos, sin, pool, table, lens, n_new) -> (hidden, cos, sin, None, pages)
            args = [*args[:3], None, PagedCache(*args[3:], PAGE_TOKENS)]
        if self.kind == "embedding":
            outs = (b.embed(*args),)
        elif self.kind == "head":
            outs = (b.head(*args),)
        else:
            outs = b.block(self.layer, *args)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((n, o.detach().float().cpu().numpy()) for n, o in zip(self.outputs, outs))

