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

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        meta = TensorMetadata()
        for n in self.inputs:
            rank = {"input_ids": 2, "latent_cache": 3}.get(n, 3)
            meta.add(n, DataType.INT64 if n == "input_ids" else DataType.FLOAT32, [-1] * rank)
        return meta

    def infer_impl(self, feed_dict):
        b = self.backend
        start = time.perf_counter()
        args = []
        for n in self.inputs:
            t = torch.from_numpy(np.ascontiguousarray(feed_dict[n])).to(b.device)
            args.append(t if t.dtype == torch.int64 or n == "attention_mask" else t.to(b.act_dtype))
        if self.kind == "embedding":
            outs = (b.embed(*args),)
        elif self.kind == "head":
            outs = (b.head(*args),)
        else:
            outs = b.block(self.layer, *args)
        self.inference_time = time.perf_counter() - start
        return OrderedDict((n, o.detach().float().cpu().numpy()) for n, o in zip(self.outputs, outs))
