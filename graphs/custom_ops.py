"""The node contracts of graphs/contracts.py as torch.library custom ops, so the torch reference calls the very
operations the exported graphs name: torch.ops.k2trt.fp8_block_linear, torch.ops.k2trt.moe_fp8,
torch.ops.k2trt.moe_int4, torch.ops.k2trt.mla_paged_decode and torch.ops.k2trt.mla_paged_prefill."""

from __future__ import annotations

import torch

from k2trt.graphs.fp8 import fp8_block_linear as _fp8_block_linear
from k2trt.graphs.mla_ref import paged_mla_decode_reference, paged_mla_prefill_reference
from k2trt.graphs.moe_ref import moe_fp8_reference, moe_int4_reference


@torch.library.custom_op("k2trt::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     activation_quant: int) -> torch.Tensor:
    return _fp8_block_linear(x, weight, weight_scale_inv, activation_quant)


@fp8_block_linear.register_fake
def _(x, weight, weight_scale_inv, activation_quant):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("k2trt::moe_fp8", mutates_args=())
def moe_fp8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            gate_weight: torch.Tensor, gate_scale_inv: torch.Tensor,
            up_weight: torch.Tensor, up_scale_inv: torch.Tensor,
            down_weight: torch.Tensor, down_scale_inv: torch.Tensor,
            activation_quant: int) -> torch.Tensor:
    return moe_fp8_reference(x, topk_ids, topk_weights, gate_weight, gate_scale_inv, up_weight, up_scale_inv,
                             down_weight, down_scale_inv, activation_quant)


@moe_fp8.register_fake
def _(x, *args):
    return torch.empty_like(x)


@torch.library.custom_op("k2trt::moe_int4", mutates_args=())
def moe_int4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             gate_weight_packed: torch.Tensor, gate_weight_scale: torch.Tensor,
             up_weight_packed: torch.Tensor, up_weight_scale: torch.Tensor,
             down_weight_packed: torch.Tensor, down_weight_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return moe_int4_reference(x, topk_ids, topk_weights, gate_weight_packed, gate_weight_scale, up_weight_packed,
                              up_weight_scale, down_weight_packed, down_weight_scale)


@moe_int4.register_fake
def _(x, *args):
    return torch.empty_like(x)


@torch.library.custom_op("k2trt::mla_paged_decode", mutates_args=())
def mla_paged_decode(q_full: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor, ctx_lens: torch.Tensor,
                     latent_new: torch.Tensor, n_new: torch.Tensor, softmax_scale: float, page_tokens: int,
                     latent_dim: int) -> torch.Tensor:
    return paged_mla_decode_reference(q_full, kv_pool, page_table, ctx_lens, softmax_scale, page_tokens,
                                      latent_dim=latent_dim, new=latent_new, n_new=n_new)


@mla_paged_decode.register_fake
def _(q_full, kv_pool, page_table, ctx_lens, latent_new, n_new, softmax_scale, page_tokens, latent_dim):
    return q_full.new_empty((*q_full.shape[:-1], latent_dim))


@torch.library.custom_op("k2trt::mla_paged_prefill", mutates_args=())
def mla_paged_prefill(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor, ctx_lens: torch.Tensor,
                      latent_new: torch.Tensor, n_new: torch.Tensor, kv_b: torch.Tensor, softmax_scale: float,
                      page_tokens: int, latent_dim: int, v_head_dim: int) -> torch.Tensor:
    return paged_mla_prefill_reference(q, kv_pool, page_table, ctx_lens, n_new, kv_b, softmax_scale, page_tokens,
                                       v_head_dim, latent_dim=latent_dim, new=latent_new)


@mla_paged_prefill.register_fake
def _(q, kv_pool, page_table, ctx_lens, latent_new, n_new, kv_b, softmax_scale, page_tokens, latent_dim, v_head_dim):
    return q.new_empty((*q.shape[:-1], v_head_dim))
