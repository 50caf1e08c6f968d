"""Tolerances that follow the output dtype, so a comparison passes on any x86-64 CPU.

A kernel and its reference may sum in another order (the interpreter's NumPy BLAS and torch's differ between
Intel and AMD CPUs), so an fp32 result may differ in its last bits — and when the output is 16-bit, that is enough
to round an element to the neighbouring float16 / bfloat16 value: one ulp of the output dtype. So every
elementwise comparison allows one ulp of the output dtype (relative: an ulp is at most 2^-p·|x|,
k2trt/dtypes.one_ulp) plus an absolute term relative to the largest reference value for the fp32 summation order.
"""

from __future__ import annotations

import torch

from k2trt.dtypes import name_of
from k2trt.dtypes import one_ulp as _one_ulp

TIGHT = 1e-5  # fp32 summation order, relative to max|reference|


def one_ulp(dtype: torch.dtype) -> float:
    return _one_ulp(name_of(dtype))


def assert_close(y: torch.Tensor, ref: torch.Tensor, tol: float = TIGHT, dtype: torch.dtype | None = None) -> None:
    """|y - ref| <= one ulp of `dtype` (default: y's) · |ref| + tol · max|ref|, elementwise."""
    r = ref.float()
    torch.testing.assert_close(y.float(), r, rtol=one_ulp(dtype or y.dtype),
                               atol=tol * r.abs().max().item() + 1e-30)
