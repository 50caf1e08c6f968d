"""The routed-expert computation of one MoE layer in plain torch, following moe_infer of modeling_deepseek.py:
sort the (token, expert) pairs by expert, run each expert on its tokens, scatter back, weight and sum in fp32.

This is the reference for the MoeFp8 node contract, the Triton grouped-GEMM kernels and the plugins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2trt.graphs.fp8 import WEIGHT_DEQUANT, fp8_block_linear


def expert_swiglu(x, gate_w, gate_s, up_w, up_s, down_w, down_s, activation_quant=WEIGHT_DEQUANT):
    """down(silu(gate(x)) * up(x)) with FP8 block-scaled weights; in W8A8 mode the down GEMM re-quantizes
    its input in 1x128 groups, as the fused kernels do."""
    g = fp8_block_linear(x, gate_w, gate_s, activation_quant)
    u = fp8_block_linear(x, up_w, up_s, activation_quant)
    return fp8_block_linear(F.silu(g) * u, down_w, down_s, activation_quant)


def moe_fp8_reference(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s,
                      activation_quant: int = WEIGHT_DEQUANT):
    """x [.., d], topk_ids [.., k] (int), topk_weights [.., k] (fp32) -> Σ_k w_k · expert_{id_k}(x)  [.., d]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    ids = topk_ids.reshape(x2.shape[0], -1).long()
    w = topk_weights.reshape(x2.shape[0], -1).float()
    k = ids.shape[1]
    order = ids.view(-1).argsort(stable=True)
    counts = torch.bincount(ids.view(-1), minlength=gate_w.shape[0]).tolist()
    sorted_tokens = x2[order // k]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outs.append(expert_swiglu(sorted_tokens[start:start + n], gate_w[e], gate_s[e], up_w[e], up_s[e],
                                  down_w[e], down_s[e], activation_quant))
        start += n
    out_sorted = torch.cat(outs) if outs else sorted_tokens.new_empty(0, shape[-1])
    per_pair = torch.empty_like(out_sorted)
    per_pair[order] = out_sorted
    y = (per_pair.view(x2.shape[0], k, -1).float() * w.unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype).reshape(shape)
