"""k2trt/dtypes.py writes ONNX's element-type numbers out (so a runtime process never imports onnx): each must be
the one onnx.TensorProto gives the type, and each spelling must round-trip through its library."""

import numpy as np
import onnx
import torch

from k2trt.dtypes import _ALL, BY_ONNX, BY_SAFETENSORS, BY_TORCH


def test_the_onnx_numbers_are_tensorprotos():
    for d in _ALL:
        name = {"float8_e4m3fn": "FLOAT8E4M3FN", "float8_e5m2": "FLOAT8E5M2", "float32": "FLOAT", "float64": "DOUBLE"}.get(d.name)
        assert d.onnx == getattr(onnx.TensorProto, name or d.name.upper()), d.name
        assert BY_ONNX[d.onnx] is d and BY_TORCH[d.torch] is d and BY_SAFETENSORS[d.safetensors] is d
        if d.numpy is not None:
            assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx) == np.dtype(d.numpy)
            assert torch.from_numpy(np.zeros(1, d.numpy)).dtype == d.torch
