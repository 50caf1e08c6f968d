"""Per-layer weight preparation for a graph's weight inputs, done once per backend when a layer is bound.

The manifest gives, for each graph, which inputs are prepared and from which checkpoint tensors
(export/lower_ort.py); every other weight input is the checkpoint tensor itself, cast to the graph's dtype."""

from __future__ import annotations

import torch

from k2trt.graphs.fp8 import dequant_weight

def prepare(op: str, sources: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if op == "dequant_t":
        w, s = sources
        return dequant_weight(w, s, dtype).T.contiguous()
    if op == "dequant":
        w, s = sources
        return dequant_weight(w, s, dtype).contiguous()
    if op == "moe_fc1_interleaved":
        # ONNX Runtime's fused SwiGLU reads gate and up rows interleaved: g0, u0, g1, u1, ...
        gw, gs, uw, us = sources
        g, u = dequant_weight(gw, gs, dtype), dequant_weight(uw, us, dtype)
        e, inter, d = g.shape
        return torch.stack([g, u], dim=2).reshape(e, 2 * inter, d).contiguous()
    raise ValueError(f"unknown weight preparation {op!r}")


def as_graph_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as a graph input: bf16 tensors take the activation dtype; fp8 and fp32 stay."""
    if t.dtype in (torch.bfloat16, torch.float16) and t.dtype != dtype:
        return t.to(dtype)
    return t


def graph_weights(entry: dict, source: dict, dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
    """One layer's weight inputs for a graph of the manifest: prepared where the entry says so, otherwise the
    checkpoint tensor in the graph's dtype. Sources move to `device` first, so preparation runs there."""
    move = (lambda t: t) if device is None else (lambda t: t.to(device))  # noqa: E731
    out = {}
    for name in entry["weights"]:
        if name in entry["prep"]:
            p = entry["prep"][name]
            out[name] = prepare(p["op"], [move(source[s]) for s in p["from"]], dtype)
        else:
            out[name] = as_graph_dtype(move(source[name]), dtype)
    return out
