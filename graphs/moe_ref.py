"""The routed-expert computation of one MoE layer in plain torch, following moe_infer of modeling_deepseek.py:
sort the (token, expert) pairs by expert, run each expert on its tokens, scatter back, weight and sum in fp32.

It is written as the four stages of graphs/contracts.MOE_STAGES (align, gate+up, down, combine), so the MoeFp8
node and its expansion for TensorRT (export/split_moe.py) have one definition: moe_fp8_reference is exactly
their composition. These are the references of the node contracts, the Triton kernels and the plugins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2trt.graphs.fp8 import (BLOCK, PER_TOKEN_GROUP, WEIGHT_DEQUANT, cdiv, fp8_block_linear,
                              fp8_block_linear_quantized, quantize_activation)


def expert_swiglu(x, gate_w, gate_s, up_w, up_s, down_w, down_s, activation_quant=WEIGHT_DEQUANT):
    """down(silu(gate(x)) * up(x)) with FP8 block-scaled weights; in W8A8 mode the down GEMM re-quantizes
    its input in 1x128 groups, as the fused kernels do."""
    g = fp8_block_linear(x, gate_w, gate_s, activation_quant)
    u = fp8_block_linear(x, up_w, up_s, activation_quant)
    return fp8_block_linear(F.silu(g) * u, down_w, down_s, activation_quant)


def _runs(expert_offsets: torch.Tensor):
    """(expert, row slice) of each expert with pairs."""
    off = expert_offsets.tolist()
    return [(e, slice(off[e], off[e + 1])) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MoeAlign: topk_ids [.., k] -> (sorted_pairs int32 [n], expert_offsets int32 [E + 1])."""
    flat = topk_ids.reshape(-1).long().clamp(0, num_experts - 1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order.to(torch.int32), offsets.to(torch.int32)


def moe_gate_up_reference(x, sorted_pairs, expert_offsets, gate_w, gate_s, up_w, up_s,
                          activation_quant: int = WEIGHT_DEQUANT) -> tuple[torch.Tensor, torch.Tensor]:
    """MoeGateUp: -> (h [n, I], h_scale float32 [n, ceil(I/128)]); h is fp8 under W8A8, x's dtype otherwise."""
    x2 = x.reshape(-1, x.shape[-1])
    n, inter = sorted_pairs.numel(), gate_w.shape[1]
    top_k = n // max(1, x2.shape[0])
    tokens = x2[sorted_pairs.long() // top_k]
    h = x2.new_zeros(n, inter)
    for e, rows in _runs(expert_offsets):
        g = fp8_block_linear(tokens[rows], gate_w[e], gate_s[e], activation_quant)
        u = fp8_block_linear(tokens[rows], up_w[e], up_s[e], activation_quant)
        h[rows] = F.silu(g) * u
    if activation_quant == PER_TOKEN_GROUP:
        return quantize_activation(h)
    return h, torch.ones(n, cdiv(inter, BLOCK), dtype=torch.float32, device=x.device)


def moe_down_reference(h, h_scale, sorted_pairs, expert_offsets, down_w, down_s, activation_quant: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """MoeDown: -> pair_out [n, d] in out_dtype, row p the expert output of pair p."""
    n, d = sorted_pairs.numel(), down_w.shape[1]
    out = torch.zeros(n, d, dtype=out_dtype, device=h.device)
    for e, rows in _runs(expert_offsets):
        if activation_quant == PER_TOKEN_GROUP:
            y = fp8_block_linear_quantized(h[rows], h_scale[rows], down_w[e], down_s[e], out_dtype)
        else:
            y = fp8_block_linear(h[rows], down_w[e], down_s[e], activation_quant)
        out[sorted_pairs[rows].long()] = y
    return out


def moe_combine_reference(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """MoeCombine: -> y [.., d] (topk_weights' leading shape) = Σ_j w[t, j] · pair_out[t·k + j] in fp32."""
    k = topk_weights.shape[-1]
    w = topk_weights.reshape(-1, k).float()
    y = (pair_out.view(w.shape[0], k, -1).float() * w.unsqueeze(-1)).sum(dim=1)
    return y.to(pair_out.dtype).reshape(*topk_weights.shape[:-1], pair_out.shape[-1])


def moe_fp8_reference(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s,
                      activation_quant: int = WEIGHT_DEQUANT):
    """x [.., d], topk_ids [.., k] (int), topk_weights [.., k] (fp32) -> Σ_k w_k · expert_{id_k}(x)  [.., d]:
    the four stages in order."""
    sorted_pairs, offsets = moe_align_reference(topk_ids, gate_w.shape[0])
    h, h_scale = moe_gate_up_reference(x, sorted_pairs, offsets, gate_w, gate_s, up_w, up_s, activation_quant)
    pair_out = moe_down_reference(h, h_scale, sorted_pairs, offsets, down_w, down_s, activation_quant, x.dtype)
    return moe_combine_reference(pair_out, topk_weights.reshape(*x.shape[:-1], -1)).reshape(x.shape)
