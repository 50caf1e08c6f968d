"""The math of an EAGLE-3 draft (k2trt/draft.py's Llama layout), written once against the ops vocabulary of
graphs/ops.py, as graphs/blocks.py writes the target's:

  draft_fc(aux)                                         -> hidden [B, T, H]: fc over the target's residual stream at
                                                           three depths, concatenated [B, T, 3 × target H]
  draft_layer(embeds, hidden, rope, mask, past k/v)     -> out [B, T, H] (fed back as the next step's hidden),
                                                           k_new, v_new [B, kv heads, T, head dim]
  draft_head(out)                                       -> logits [B, T, draft vocab] float32

The layer (vLLM's llama_eagle3, SGLang's): e = input_layernorm(embed(token)), h = hidden_norm(hidden), attention over
concat(e, h) (2 × H wide) with Llama's rotary embedding (halves, theta = rope_theta) and grouped KV heads, the
residual the hidden as given (hidden_norm(hidden) with norm_before_residual), then post_attention_layernorm and a
SwiGLU MLP with its residual. Scores and softmax in float32; the mask is the step's additive mask (graphs/mask.py)
over the past slots and the new positions, the past never concatenated with the new.
"""

from __future__ import annotations

import torch

from k2trt.config import K2Config
from k2trt.draft_config import LAYER, DraftConfig
from k2trt.graphs import blocks
from k2trt.graphs.blocks import rms_norm
from k2trt.graphs.fp8 import WEIGHT_DEQUANT

F32 = "float32"


def rope_tables(cfg: DraftConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary tables for positions [B, T]: cos, sin [B, T, head_dim / 2] float32."""
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim))
    angles = positions.to(torch.float64)[..., None] * inv
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(ops, x, cos, sin, head_dim: int):
    """x [B, heads, T, head_dim] in Llama's halves layout: x·cos + rotate_half(x)·sin; cos/sin [B, 1, T, d/2]."""
    x1, x2 = ops.split(x, [head_dim // 2, head_dim // 2], axis=-1)
    return ops.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def draft_fc(ops, cfg: DraftConfig, aux, w):
    """fc over the three aux hidden states [B, T, 3 × target H] (EAGLE3.1 drafts first normalize each)."""
    if "fc_norm.0.weight" in w:
        parts = ops.split(aux, [cfg.target_hidden_size] * 3, axis=-1)
        aux = ops.concat([rms_norm(ops, p, w[f"fc_norm.{i}.weight"], cfg.rms_norm_eps) for i, p in enumerate(parts)],
                         axis=-1)
    return ops.linear(aux, w["fc.weight"])


def draft_layer(ops, cfg: DraftConfig, embeds, hidden, cos, sin, mask, past_k, past_v, w):
    """The decoder layer over T new positions. embeds, hidden [B, T, H]; cos/sin [B, T, head_dim / 2]; mask
    [B, T, P + T]; past_k/past_v [B, kv heads, P, head_dim] -> (out [B, T, H], k_new, v_new)."""
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x, residual = _inputs(ops, cfg, embeds, hidden, w)

    def project(name, n):
        y = ops.linear(x, w[LAYER + f"self_attn.{name}.weight"])
        return ops.transpose(ops.reshape(y, [0, 0, n, hd]), [0, 2, 1, 3])  # [B, n, T, hd]

    c, s = ops.unsqueeze(cos, 1), ops.unsqueeze(sin, 1)
    q = apply_rope(ops, project("q_proj", heads), c, s, hd)
    k_new = apply_rope(ops, project("k_proj", kv_heads), c, s, hd)
    v_new = project("v_proj", kv_heads)
    # grouped KV heads (query head h reads KV head h // group, as Llama's repeat_kv): a KV head's query heads
    # stacked along T, so each KV head is read once and nothing is repeated
    q = ops.reshape(q, [0, kv_heads, -1, hd])  # [B, kv, group·T, hd]
    s_past = ops.matmul(q, ops.transpose(past_k, [0, 1, 3, 2]))  # [B, kv, group·T, P]
    s_new = ops.matmul(q, ops.transpose(k_new, [0, 1, 3, 2]))  # [B, kv, group·T, T]
    scores = ops.reshape(ops.cast(ops.concat([s_past, s_new], axis=-1), F32), [0, heads, -1, 0]) * hd ** -0.5
    probs = ops.cast(ops.softmax(scores + ops.unsqueeze(mask, 1), axis=-1), "act")  # [B, heads, T, P + T]
    probs = ops.reshape(probs, [0, kv_heads, -1, 0])
    p_past, p_new = ops.split_at(probs, ops.dim(past_k, 2), axis=-1)
    o = ops.reshape(ops.matmul(p_past, past_v) + ops.matmul(p_new, v_new), [0, heads, -1, hd])  # [B, heads, T, hd]
    o = ops.reshape(ops.transpose(o, [0, 2, 1, 3]), [0, 0, heads * hd])
    return _mlp_tail(ops, cfg, ops.linear(o, w[LAYER + "self_attn.o_proj.weight"]), residual, w), k_new, v_new


def _inputs(ops, cfg: DraftConfig, embeds, hidden, w):
    """(concat(input_layernorm(embeds), hidden_norm(hidden)) [B, T, 2H], the residual)."""
    e = rms_norm(ops, embeds, w[LAYER + "input_layernorm.weight"], cfg.rms_norm_eps)
    h = rms_norm(ops, hidden, w[LAYER + "hidden_norm.weight"], cfg.rms_norm_eps)
    return ops.concat([e, h], axis=-1), (h if cfg.norm_before_residual else hidden)


def _mlp_tail(ops, cfg: DraftConfig, attn_out, residual, w):
    h1 = attn_out + residual
    m = rms_norm(ops, h1, w[LAYER + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate = ops.silu(ops.linear(m, w[LAYER + "mlp.gate_proj.weight"]))
    return ops.linear(gate * ops.linear(m, w[LAYER + "mlp.up_proj.weight"]), w[LAYER + "mlp.down_proj.weight"]) + h1


def draft_layer_mla(ops, cfg: DraftConfig, attn_cfg: K2Config, embeds, hidden, rope_cos, rope_sin, mask,
                    latent_cache, w):
    """The MLA layout's layer (Eagle3DeepseekV2ForCausalLM): the same inputs and MLP as draft_layer, its attention
    the target's MLA (graphs/blocks.attention, absorbed or decompressed by T) over concat(e, h), with its own latent
    cache [B, P, kv_lora + rope] and K2's rotary tables (graphs/rope.rope_tables of attn_cfg: DeepSeek's YaRN where
    the draft's config has rope_scaling) -> (out [B, T, H], latent_new [B, T, kv_lora + rope])."""
    x, residual = _inputs(ops, cfg, embeds, hidden, w)
    attn_w = {name[len(LAYER):]: t for name, t in w.items() if name.startswith(LAYER + "self_attn.")}
    attn_out, latent_new = blocks.attention(ops, attn_cfg, "dense_block", x, rope_cos, rope_sin, mask,
                                            latent_cache, attn_w, WEIGHT_DEQUANT)
    return _mlp_tail(ops, cfg, attn_out, residual, w), latent_new


def draft_head(ops, cfg: DraftConfig, out, w):
    """norm, then lm_head: logits over the draft vocabulary, float32."""
    return ops.cast(ops.linear(rms_norm(ops, out, w["norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"]), F32)
