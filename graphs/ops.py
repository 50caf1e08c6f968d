"""The small operator vocabulary the block math is written in.

graphs/blocks.py calls only these; `TorchOps` runs them eagerly (the torch reference) and
`k2trt.export.onnx_ops.OnnxOps` records them as ONNX nodes (the export). Semantics follow ONNX where the two
differ (reshape: 0 copies a dimension, -1 is inferred). Dtypes are named by strings: "float32", "int32",
"int64", and "act" for the activation dtype of the graph (float32 on CPU, bfloat16 on GPU).
Arithmetic between tensors uses Python operators; a Python number on either side takes the tensor's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import k2trt.graphs.custom_ops  # noqa: F401  (registers torch.ops.k2trt.*)
from k2trt.dtypes import torch_dtype
from k2trt.graphs.fp8 import dequant_weight
from k2trt.graphs.moe_ref import moe_combine_reference


class TorchOps:
    def __init__(self, act_dtype: str = "float32"):
        self.act_dtype = act_dtype
        self.act = torch_dtype(act_dtype)

    def _dtype(self, name: str) -> torch.dtype:
        return self.act if name == "act" else torch_dtype(name)

    # ---- shape -----------------------------------------------------------------------------------
    def reshape(self, x, shape):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return x.reshape(shape)

    def transpose(self, x, perm):
        return x.permute(*perm)

    def unsqueeze(self, x, axis):
        return x.unsqueeze(axis)

    def split(self, x, sizes, axis):
        return list(torch.split(x, list(sizes), dim=axis))

    def split_at(self, x, n, axis):
        """(x[:n], x[n:]) along axis; n comes from dim()."""
        return x.narrow(axis, 0, n), x.narrow(axis, n, x.shape[axis] - n)

    def dim(self, x, axis):
        return x.shape[axis]

    def concat(self, xs, axis):
        return torch.cat(xs, dim=axis)

    def at_least(self, a, b):
        return a >= b

    def const_like(self, value, like):
        return value

    def choose(self, cond, then, otherwise):
        """then() where cond() (computed from shapes: dim, const_like, at_least) holds, else otherwise(): both
        callables give the same result, each its own way of computing it."""
        return then() if cond() else otherwise()

    # ---- elementwise / reductions ------------------------------------------------------------------
    def cast(self, x, dtype):
        return x.to(self._dtype(dtype))

    def rsqrt(self, x):
        return torch.rsqrt(x)

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def silu(self, x):
        return F.silu(x)

    def reduce_mean(self, x, axis, keepdims=True):
        return x.mean(dim=axis, keepdim=keepdims)

    def reduce_sum(self, x, axis, keepdims=True):
        return x.sum(dim=axis, keepdim=keepdims)

    def softmax(self, x, axis):
        return torch.softmax(x, dim=axis)

    def zeros_like(self, x):
        return torch.zeros_like(x)

    # ---- matmul / gather ---------------------------------------------------------------------------
    def matmul(self, a, b):
        return a @ b

    def linear(self, x, w):
        """x · wᵀ for an unquantized weight [N, K]."""
        return x @ w.T

    def gather_rows(self, table, ids):
        return table[ids]

    def topk(self, x, k, axis=-1):
        v, i = torch.topk(x, k, dim=axis)
        return v, i

    def gather_elements(self, x, idx, axis):
        return torch.gather(x, axis, idx)

    def scatter_elements(self, data, idx, updates, axis):
        return data.scatter(axis, idx, updates)

    # ---- FP8 (the custom nodes, and the standard dequantization) -----------------------------------
    def dequant_fp8(self, w, scale_inv):
        return dequant_weight(w, scale_inv, self.act)

    def fp8_linear(self, x, w, scale_inv, activation_quant):
        return torch.ops.k2trt.fp8_block_linear(x, w, scale_inv, activation_quant)

    def moe_fp8(self, x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s, activation_quant):
        return torch.ops.k2trt.moe_fp8(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s,
                                       activation_quant)

    def moe_combine(self, pair_out, topk_weights):
        """The MoeCombine node (the routed experts' last stage), on its own where expert parallelism splits them."""
        return moe_combine_reference(pair_out, topk_weights)

    # ---- INT4 routed experts (the MoeInt4 node) ------------------------------------------------------------
    def moe_int4(self, x, topk_ids, topk_weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size):
        return torch.ops.k2trt.moe_int4(x, topk_ids, topk_weights, gate_p, gate_s, up_p, up_s, down_p, down_s,
                                        group_size)

    # ---- paged MLA attention (the MlaPagedDecode node) ------------------------------------------------------
    def mla_paged_decode(self, q_full, kv_pool, page_table, ctx_lens, latent_new, n_new, softmax_scale: float,
                         page_tokens: int, latent_dim: int, heads: int):
        return torch.ops.k2trt.mla_paged_decode(q_full, kv_pool, page_table, ctx_lens, latent_new, n_new,
                                                float(softmax_scale), int(page_tokens), int(latent_dim))

    def mla_paged_prefill(self, q, kv_pool, page_table, ctx_lens, latent_new, n_new, kv_b, softmax_scale: float,
                          page_tokens: int, latent_dim: int, heads: int, nope_dim: int, rope_dim: int,
                          v_head_dim: int):
        return torch.ops.k2trt.mla_paged_prefill(q, kv_pool, page_table, ctx_lens, latent_new, n_new, kv_b,
                                                 float(softmax_scale), int(page_tokens), int(latent_dim),
                                                 int(v_head_dim))
