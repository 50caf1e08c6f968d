"""The routed-expert computation of one MoE layer in plain torch, following moe_infer of modeling_deepseek.py:
sort the (token, expert) pairs by expert, run each expert on its tokens, scatter back, weight and sum in fp32.

It is written as the four stages of graphs/contracts.MOE_STAGES (align, gate+up, down, combine), so the MoeFp8
node and its expansion for TensorRT (export/split_moe.py) have one definition: moe_fp8_reference is exactly
their composition. The INT4 experts (MoeInt4, W4A16: graphs/int4.py) share the align and combine stages and the
grouped structure of the two GEMMs; only the per-expert linear differs. These are the references of the node
contracts, the Triton kernels and the plugins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2trt.graphs.fp8 import (BLOCK, PER_TOKEN_GROUP, WEIGHT_DEQUANT, cdiv, fp8_block_linear,
                              fp8_block_linear_quantized, quantize_activation)
from k2trt.graphs.int4 import int4_linear


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


def _gate_up(x, sorted_pairs, expert_offsets, inter: int, linear) -> torch.Tensor:
    """h [n, I] in x's dtype: for each sorted row, SiLU(gate)·up of its token by its expert; linear(t, e, which)
    is expert e's gate or up projection of tokens t."""
    x2 = x.reshape(-1, x.shape[-1])
    n = sorted_pairs.numel()
    top_k = n // max(1, x2.shape[0])
    tokens = x2[sorted_pairs.long() // top_k]
    h = x2.new_zeros(n, inter)
    for e, rows in _runs(expert_offsets):
        h[rows] = F.silu(linear(tokens[rows], e, "gate")) * linear(tokens[rows], e, "up")
    return h


def _down(h, sorted_pairs, expert_offsets, d: int, out_dtype: torch.dtype, linear) -> torch.Tensor:
    """pair_out [n, d]: row p the down projection of pair p's h row; linear(rows, e) of expert e."""
    out = torch.zeros(sorted_pairs.numel(), d, dtype=out_dtype, device=h.device)
    for e, rows in _runs(expert_offsets):
        out[sorted_pairs[rows].long()] = linear(rows, e)
    return out


def moe_gate_up_reference(x, sorted_pairs, expert_offsets, gate_w, gate_s, up_w, up_s,
                          activation_quant: int = WEIGHT_DEQUANT) -> tuple[torch.Tensor, torch.Tensor]:
    """MoeGateUp: -> (h [n, I], h_scale float32 [n, ceil(I/128)]); h is fp8 under W8A8, x's dtype otherwise."""
    n, inter = sorted_pairs.numel(), gate_w.shape[1]
    weights = {"gate": (gate_w, gate_s), "up": (up_w, up_s)}
    h = _gate_up(x, sorted_pairs, expert_offsets, inter,
                 lambda t, e, which: fp8_block_linear(t, weights[which][0][e], weights[which][1][e], activation_quant))
    if activation_quant == PER_TOKEN_GROUP:
        return quantize_activation(h)
    return h, torch.ones(n, cdiv(inter, BLOCK), dtype=torch.float32, device=x.device)


def moe_down_reference(h, h_scale, sorted_pairs, expert_offsets, down_w, down_s, activation_quant: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """MoeDown: -> pair_out [n, d] in out_dtype, row p the expert output of pair p."""
    def linear(rows, e):
        if activation_quant == PER_TOKEN_GROUP:
            return fp8_block_linear_quantized(h[rows], h_scale[rows], down_w[e], down_s[e], out_dtype)
        return fp8_block_linear(h[rows], down_w[e], down_s[e], activation_quant)

    return _down(h, sorted_pairs, expert_offsets, down_w.shape[1], out_dtype, linear)


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


# ---- INT4 (W4A16) experts: MoeGateUpInt4 and MoeDownInt4 ----------------------------------------------------

def moe_gate_up_int4_reference(x, sorted_pairs, expert_offsets, gate_p, gate_s, up_p, up_s) -> torch.Tensor:
    """MoeGateUpInt4: -> h [n, I] in x's dtype (weights: packed int32 [E, I, d/8], scales [E, I, d/g])."""
    weights = {"gate": (gate_p, gate_s), "up": (up_p, up_s)}
    return _gate_up(x, sorted_pairs, expert_offsets, gate_p.shape[1],
                    lambda t, e, which: int4_linear(t, weights[which][0][e], weights[which][1][e]))


def moe_down_int4_reference(h, sorted_pairs, expert_offsets, down_p, down_s) -> torch.Tensor:
    """MoeDownInt4: -> pair_out [n, d] in h's dtype (down: packed int32 [E, d, I/8], scales [E, d, I/g])."""
    return _down(h, sorted_pairs, expert_offsets, down_p.shape[1], h.dtype,
                 lambda rows, e: int4_linear(h[rows], down_p[e], down_s[e]))


def moe_int4_reference(x, topk_ids, topk_weights, gate_p, gate_s, up_p, up_s, down_p, down_s):
    """MoeInt4: x [.., d] -> Σ_k w_k · expert_{id_k}(x) [.., d] with INT4 experts: align, gate+up, down, combine."""
    sorted_pairs, offsets = moe_align_reference(topk_ids, gate_p.shape[0])
    h = moe_gate_up_int4_reference(x, sorted_pairs, offsets, gate_p, gate_s, up_p, up_s)
    pair_out = moe_down_int4_reference(h, sorted_pairs, offsets, down_p, down_s)
    return moe_combine_reference(pair_out, topk_weights.reshape(*x.shape[:-1], -1)).reshape(x.shape)
