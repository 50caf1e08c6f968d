"""Weight preparations: graph inputs made from checkpoint tensors once per layer, when weights are bound.

One registry, name -> (shape rule, torch implementation). The exporter records a preparation where a graph needs a
weight in another form than the checkpoint's (`record`, which also gives the prepared input's shape), the manifest
carries those records, and every backend applies them with `apply`: the vocabulary is defined here and nowhere else.
Prepared inputs take the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k2trt.graphs import int4
from k2trt.graphs.fp8 import dequant_weight

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Preparation:
    name: str
    sources: tuple[str, ...]  # what each source tensor is, in order
    shape: Callable[[list[Shape]], Shape]  # source shapes -> the prepared input's shape
    make: Callable[[list[torch.Tensor], torch.dtype], torch.Tensor]
    doc: str

    def record(self, sources: list[str], shapes: list[Shape]) -> tuple[dict, Shape]:
        """The manifest record of this preparation from the named graph inputs, and the prepared shape."""
        if len(sources) != len(self.sources) or len(shapes) != len(self.sources):
            raise ValueError(f"{self.name} takes {len(self.sources)} sources ({', '.join(self.sources)})")
        return {"op": self.name, "from": list(sources)}, tuple(self.shape([tuple(s) for s in shapes]))

    def apply(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        out = self.make(tensors, dtype).contiguous()
        want = self.shape([tuple(t.shape) for t in tensors])
        if tuple(out.shape) != want:  # the shape rule and the implementation must agree
            raise AssertionError(f"{self.name}: made {tuple(out.shape)}, its shape rule says {want}")
        return out


def _dequant(t: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    w, s = t
    return dequant_weight(w, s, dtype)


def _dequant_t(t: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return _dequant(t, dtype).transpose(-1, -2)


def _interleaved(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    e, inter, d = g.shape
    return torch.stack([g, u], dim=2).reshape(e, 2 * inter, d)


def _interleave_gate_up(t: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    gw, gs, uw, us = t
    return _interleaved(dequant_weight(gw, gs, dtype), dequant_weight(uw, us, dtype))


def _int4_dequant(t: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    packed, scale = t
    return int4.dequant_weight(packed, scale, dtype)


def _interleave_gate_up_int4(t: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    gp, gs, up, us = t
    return _interleaved(int4.dequant_weight(gp, gs, dtype), int4.dequant_weight(up, us, dtype))


def _unpacked(s: list[Shape]) -> Shape:
    """[.., N, K/8] packed int4 -> [.., N, K]."""
    return (*s[0][:-1], s[0][-1] * int4.PACK_FACTOR)


DEQUANT = Preparation(
    "dequant", ("fp8 weight [.., N, K]", "block scales"), lambda s: s[0], _dequant,
    "FP8 weight × its 128×128 block scales, in the activation dtype (stacked experts too)")
DEQUANT_T = Preparation(
    "dequant_t", ("fp8 weight [N, K]", "block scales"), lambda s: (*s[0][:-2], s[0][-1], s[0][-2]), _dequant_t,
    "dequantized and transposed to [K, N], the right operand of MatMul(x, W)")
MOE_FC1_INTERLEAVED = Preparation(
    "moe_fc1_interleaved", ("gate [E, I, d]", "gate scales", "up [E, I, d]", "up scales"),
    lambda s: (s[0][0], 2 * s[0][1], s[0][2]), _interleave_gate_up,
    "gate and up dequantized, rows interleaved g0, u0, g1, u1, … as ONNX Runtime's fused SwiGLU reads them")

INT4_DEQUANT = Preparation(
    "int4_dequant", ("int4 packed [.., N, K/8]", "group scales [.., N, K/g]"), _unpacked, _int4_dequant,
    "INT4 weight unpacked and dequantized, bf16(q·s), in the activation dtype (stacked experts too)")
MOE_FC1_INTERLEAVED_INT4 = Preparation(
    "moe_fc1_interleaved_int4", ("gate packed [E, I, d/8]", "gate scales", "up packed [E, I, d/8]", "up scales"),
    lambda s: (s[0][0], 2 * s[0][1], s[0][2] * int4.PACK_FACTOR), _interleave_gate_up_int4,
    "INT4 gate and up dequantized, rows interleaved g0, u0, g1, u1, … as ONNX Runtime's fused SwiGLU reads them")

PREPARATIONS: dict[str, Preparation] = {p.name: p for p in (DEQUANT, DEQUANT_T, MOE_FC1_INTERLEAVED, INT4_DEQUANT,
                                                             MOE_FC1_INTERLEAVED_INT4)}


def preparation(name: str) -> Preparation:
    try:
        return PREPARATIONS[name]
    except KeyError:
        raise ValueError(f"unknown weight preparation {name!r} (known: {', '.join(PREPARATIONS)})") from None
