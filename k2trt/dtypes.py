"""The one table of element types: every dtype the project names, with its spelling in each library.

Our spelling is torch's ("float8_e4m3fn", "bfloat16", ...): it is what the weight table, the node contracts and
the manifests write. The other columns are how ONNX, safetensors, NumPy and TensorRT spell the same type, so no
module keeps a table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# DataType's numbers (onnx/onnx.proto, fixed by the spec), written out: importing onnx costs a process
# ~0.7 s (ml_dtypes) and a runtime that only runs graphs never needs it. tests/test_dtypes.py checks them.
FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, BOOL, FLOAT16, DOUBLE, UINT32, UINT64 = 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13
BFLOAT16, FLOAT8E4M3FN, FLOAT8E5M2 = 16, 17, 19


@dataclass(frozen=True)
class DType:
    name: str  # ours (= torch's attribute name)
    torch: torch.dtype
    onnx: int  # TensorProto element type
    safetensors: str  # the dtype code in a safetensors header
    numpy: type | None  # NumPy scalar type, where NumPy has one
    trt: str | None  # tensorrt.DataType member name, where TensorRT has the type

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize


_ALL = (
    DType("float32", torch.float32, FLOAT, "F32", np.float32, "FLOAT"),
    DType("float16", torch.float16, FLOAT16, "F16", np.float16, "HALF"),
    DType("bfloat16", torch.bfloat16, BFLOAT16, "BF16", None, "BF16"),
    DType("float8_e4m3fn", torch.float8_e4m3fn, FLOAT8E4M3FN, "F8_E4M3", None, "FP8"),
    DType("float8_e5m2", torch.float8_e5m2, FLOAT8E5M2, "F8_E5M2", None, None),
    DType("float64", torch.float64, DOUBLE, "F64", np.float64, None),
    DType("int8", torch.int8, INT8, "I8", np.int8, "INT8"),
    DType("uint8", torch.uint8, UINT8, "U8", np.uint8, "UINT8"),
    DType("int16", torch.int16, INT16, "I16", np.int16, None),
    DType("uint16", torch.uint16, UINT16, "U16", np.uint16, None),
    DType("int32", torch.int32, INT32, "I32", np.int32, "INT32"),
    DType("uint32", torch.uint32, UINT32, "U32", np.uint32, None),
    DType("int64", torch.int64, INT64, "I64", np.int64, "INT64"),
    DType("uint64", torch.uint64, UINT64, "U64", np.uint64, None),
    DType("bool", torch.bool, BOOL, "BOOL", np.bool_, "BOOL"),
)

DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
BY_ONNX: dict[int, DType] = {d.onnx: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _ALL}
BY_TRT: dict[str, DType] = {d.trt: d for d in _ALL if d.trt}

# The names the weight table uses
FP8 = "float8_e4m3fn"
BF16 = "bfloat16"
F32 = "float32"


def dtype(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def one_ulp(name: str) -> float:
    """The largest spacing between a value of this floating type and its neighbour, relative to the value."""
    d = dtype(name).torch
    if not d.is_floating_point:
        raise ValueError(f"{name} is not a floating type")
    return torch.finfo(d).eps


def torch_dtype(name: str) -> torch.dtype:
    return dtype(name).torch


def name_of(t: torch.dtype) -> str:
    return BY_TORCH[t].name
