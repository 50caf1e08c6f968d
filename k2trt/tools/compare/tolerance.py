"""How close a backend must come to the torch reference, per output, by the dtype its graphs compute in.

Polygraphy's "elemwise" check: an element fails only if it exceeds BOTH atol and rtol; atol is scaled by the
output's own size, max |ref| over the golden feeds:

    graph dtype   atol              rtol    why
    float32       1e-4 * max|ref|   1e-3    float32 graph vs float32 reference: only summation order differs
    float16       1e-3 * max|ref|   1e-2    10-bit mantissa, rounded at every op
    bfloat16      1e-2 * max|ref|   5e-2    8-bit mantissa, rounded at every op
    W8A8 forms take at least the bfloat16 row: activations are rounded to FP8 per 128-group (3-bit mantissa), and
    a value on a rounding boundary may round the other way than in the reference.

The end-to-end logits use the same table; greedy tokens must agree, except that a divergence where the
reference's two candidates are within the logits' atol (a near-tie) passes and is marked "near-tie".
"""

from __future__ import annotations

import torch

from k2trt.dtypes import name_of

TOLERANCES = {"float32": (1e-4, 1e-3), "float16": (1e-3, 1e-2), "bfloat16": (1e-2, 5e-2)}
W8A8_FLOOR = TOLERANCES["bfloat16"]


def tolerance(dtype: str | torch.dtype, activation_quant: int) -> tuple[float, float]:
    """(atol factor on max|ref|, rtol) for outputs of a graph computing in `dtype`."""
    name = dtype if isinstance(dtype, str) else name_of(dtype)
    atol, rtol = TOLERANCES.get(name, TOLERANCES["bfloat16"])
    if activation_quant:
        atol, rtol = max(atol, W8A8_FLOOR[0]), max(rtol, W8A8_FLOOR[1])
    return atol, rtol
