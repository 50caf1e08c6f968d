"""INT4 W4A16 linears as compressed-tensors `pack-quantized` stores them (K2-Thinking, K2.5, K2.6: the routed
experts), in plain torch.

Storage (the library's pack_to_int32): weight_packed int32 [.., N, K/8], value i of a row at bits 4i..4i+3 of
word i // 8, stored offset by +8 (so q = nibble - 8 in [-8, 7]); weight_scale [.., N, K/g], one scale per g input
channels. Symmetric, so no zero point: W[n, k] = q[n, k] · s[n, k // g].

The weight is that product as the checkpoint's scale dtype holds it: bf16(q · s), which is what compressed-tensors'
`dequantize` computes (in the scale's dtype) and what a W4A16 GPU kernel multiplies in bf16. The product is rounded
once (q and s are exact in fp32), so the value does not depend on where it is computed. Activations are never
quantized (the model was trained W4A16): y = x · Wᵀ, accumulated in fp32, in x's dtype — the same convention as
graphs/fp8.py's weight-dequant path. These functions are the reference for the lowering, the kernels and the plugins.
"""

from __future__ import annotations

import torch

from k2trt.quantization import INT4_BITS, PACK_FACTOR

WEIGHT_DTYPE = torch.bfloat16  # the dtype the dequantized weight is rounded to (the checkpoint's scale dtype)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [.., N, K/8] -> int8 [.., N, K] in [-8, 7], by the library's own unpack_from_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    *lead, n, words = packed.shape
    k = words * PACK_FACTOR
    flat = packed.reshape(-1, words).contiguous()
    return unpack_from_int32(flat, INT4_BITS, torch.Size((flat.shape[0], k))).reshape(*lead, n, k)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [.., N, K] in [-8, 7] -> int32 [.., N, K/8], by the library's own pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    *lead, n, k = q.shape
    return pack_to_int32(q.reshape(-1, k).contiguous(), INT4_BITS).reshape(*lead, n, k // PACK_FACTOR)


def group_size(packed: torch.Tensor, scale: torch.Tensor) -> int:
    return packed.shape[-1] * PACK_FACTOR // scale.shape[-1]


def dequant_weight(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """weight_packed [.., N, K/8] and weight_scale [.., N, K/g] -> W [.., N, K] = bf16(q · s), in `dtype`.
    Works for stacked experts [E, N, ..] too."""
    q = unpack(packed).to(torch.float32)
    k, groups = q.shape[-1], scale.shape[-1]
    w = q.unflatten(-1, (groups, k // groups)) * scale.to(torch.float32).unsqueeze(-1)
    return w.flatten(-2).to(WEIGHT_DTYPE).to(dtype)


def quantize_weight(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [.., N, K] -> (int8 q [.., N, K] in [-8, 7], bf16 scales [.., N, K/g]): symmetric, absmax / 7 per group,
    as a min-max observer would (the tiny checkpoints' weights; a real one comes from QAT)."""
    g = w.float().unflatten(-1, (w.shape[-1] // group, group))
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).to(WEIGHT_DTYPE)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return q.flatten(-2).contiguous(), scale.contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · Wᵀ for an INT4 group-quantized weight [N, K]: W4A16, fp32 accumulation, y in x's dtype."""
    w = dequant_weight(packed, scale, torch.float32)
    return (x.float() @ w.T).to(x.dtype)
