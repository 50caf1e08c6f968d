"""The math of every block kind, written once against the ops vocabulary of graphs/ops.py.

The torch reference runs these functions with TorchOps; the exporter runs the same functions with OnnxOps to
record the ONNX graphs. Each follows modeling_deepseek.py (see docs/ARCHITECTURE.md for the data path):

  embedding(ids)                                    -> hidden [B, T, d]
  decoder_block(hidden, rope, mask, latent_cache)   -> hidden [B, T, d], latent_new [B, T, kv_lora + rope]
  head(hidden)                                      -> logits [B, T, V] float32
  moe_front / local_experts / moe_combine           -> a MoE block split at the dispatch (expert parallelism)

`w` maps weight names (checkpoint suffixes, graphs/weights.py) to tensors. Attention reads the latent cache in
place (the past is never copied or concatenated with the new entries) and runs absorbed for a few new positions,
decompressed for many (`attention`, `decompress_from`): a branch on a shape, which the torch reference takes in
Python and the ONNX Runtime graphs as an If; the TensorRT-bound graphs hold the absorbed form for now. Given a
PagedCache instead of a gathered cache and its mask, attention reads the layer's pool through the page tables (the
MlaPagedDecode and MlaPagedPrefill nodes, chosen the same way): the paged graphs export/block_graphs.py records
with `paged=True`. Each linear is
computed in the format the checkpoint stores it in (graphs/weights.role_format): FP8 blocks as the Fp8BlockLinear
node, bf16 as a plain MatMul; the routed experts are one MoeFp8 or MoeInt4 node.
"""

from __future__ import annotations

from typing import NamedTuple

from k2trt.config import K2Config
from k2trt.graphs.weights import experts_format, role_format
from k2trt.quantization import BF16, FP8_BLOCK

F32 = "float32"


class PagedCache(NamedTuple):
    """A layer's latent cache read where it lies, in place of a gathered cache and its mask: the pool [rows,
    kv_lora + rope], each sequence's page table int32 [B, max_pages], the positions already in the pool int32 [B]
    and the step's real new positions int32 [B] (the MlaPagedDecode node's inputs, graphs/contracts.py)."""
    pool: object
    page_table: object
    ctx_lens: object
    n_new: object
    page_tokens: int


def rms_norm(ops, x, weight, eps: float):
    """DeepseekV3RMSNorm: variance in float32, cast back to the input dtype, then times the weight."""
    h = ops.cast(x, F32)
    h = h * ops.rsqrt(ops.reduce_mean(h * h, axis=-1) + eps)
    return weight * ops.cast(h, "act")


def apply_rope(ops, x, cos, sin, rope_dim: int):
    """x [B, heads, T, rope] with interleaved pairs; cos/sin [B, 1, T, rope/2].

    modeling_deepseek.py first permutes each vector from interleaved pairs to halves, then applies
    x*cos + rotate_half(x)*sin with cos = cat(freqs, freqs): the result is in the halves layout.
    """
    half = rope_dim // 2
    pairs = ops.reshape(x, [0, 0, 0, half, 2])
    even, odd = ops.split(pairs, [1, 1], axis=-1)
    even = ops.reshape(even, [0, 0, 0, half])
    odd = ops.reshape(odd, [0, 0, 0, half])
    return ops.concat([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def linear(ops, cfg: K2Config, kind: str, x, w, name: str, activation_quant: int):
    """x · Wᵀ for the linear `name` (a role of graphs/weights.linear_shapes) of a block kind, in its stored format."""
    fmt = role_format(cfg, kind, name).kind
    if fmt == FP8_BLOCK:
        return ops.fp8_linear(x, w[f"{name}.weight"], w[f"{name}.weight_scale_inv"], activation_quant)
    if fmt == BF16:
        return ops.linear(x, w[f"{name}.weight"])
    raise ValueError(f"{name}: no linear for format {fmt}")  # graphs/weights.weight_formats refuses it first


def kv_b_weight(ops, cfg: K2Config, kind: str, w):
    """kv_b as one matrix in the activation dtype: FP8 dequantized (a prepared input, onnx_ops.dequant_fp8), bf16
    as it is."""
    if role_format(cfg, kind, "self_attn.kv_b_proj").kind == FP8_BLOCK:
        return ops.dequant_fp8(w["self_attn.kv_b_proj.weight"], w["self_attn.kv_b_proj.weight_scale_inv"])
    return w["self_attn.kv_b_proj.weight"]


def decompress_costs(cfg: K2Config) -> tuple[int, int]:
    """(saved, spent) multiply-adds of the decompressed form against the absorbed one, per head: `saved` per new
    query and context position (the absorbed form scores lora + rope values and attends over the whole latent row,
    the decompressed one scores nope + rope and attends over v), `spent` per past position (its latent through
    kv_b into key and value: lora · (nope + v); the new positions' own decompression is paid back by the absorbed
    form's query and output projections, which cost as much)."""
    absorbed = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.latent_dim
    decompressed = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    return absorbed - decompressed, cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)


def decompress_from(cfg: K2Config) -> int:
    """The fewest new positions T per step that attend decompressed, over any past P: nope + v (256 for K2, 128 for
    the tiny). From there its keys and values, heads · (P + T) · (nope + v) values, are no more than its scores,
    heads · T · (P + T), so a step's working memory stays what its mask budget allows (runtime/generation/
    limits.py); and it computes less, T · (P + T) · saved ≥ P · spent, from spent / saved on (158 for K2), which
    is below nope + v for every MLA shape (nope + v < lora + rope). So prefill chunks run decompressed and decode
    (T = 1; up to 9 verifying drafts) absorbed. docs/PERFORMANCE.md has ONNX Runtime's measured crossing."""
    saved, spent = decompress_costs(cfg)
    return max(cfg.qk_nope_head_dim + cfg.v_head_dim, -(-spent // saved))


def attention(ops, cfg: K2Config, kind: str, x, rope_cos, rope_sin, mask, latent_cache, w, activation_quant: int):
    """MLA. x [B, T, d] (normalized), latent_cache [B, P, kv_lora + rope] (P slots, read in place), mask
    [B, T, P + T] -> (out [B, T, d], latent_new [B, T, kv_lora + rope]). The cache holds latents only; the
    attention runs absorbed for a few new positions over a cache (decode, speculative verify) and decompressed for
    many (prefill; `decompress_from`), as vLLM, SGLang and TensorRT-LLM choose."""
    h, nope, rope, vdim, lora = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                 cfg.v_head_dim, cfg.kv_lora_rank)
    eps = cfg.rms_norm_eps
    aq = activation_quant

    def lin(t, name):
        return linear(ops, cfg, kind, t, w, name, aq)

    # queries: q_a -> q_a_layernorm -> q_b, split into the no-position and the rotary part
    q = lin(x, "self_attn.q_a_proj")
    q = rms_norm(ops, q, w["self_attn.q_a_layernorm.weight"], eps)
    q = lin(q, "self_attn.q_b_proj")
    q = ops.transpose(ops.reshape(q, [0, 0, h, nope + rope]), [0, 2, 1, 3])  # [B, H, T, 192]
    q_nope, q_pe = ops.split(q, [nope, rope], axis=-1)

    cos = ops.unsqueeze(rope_cos, 1)  # [B, 1, T, rope/2]
    sin = ops.unsqueeze(rope_sin, 1)
    q_pe = apply_rope(ops, q_pe, cos, sin, rope)

    # the new cache entries: normalized latent and the rotated shared rope key
    ckv = lin(x, "self_attn.kv_a_proj_with_mqa")  # [B, T, 576]
    c, k_pe = ops.split(ckv, [lora, rope], axis=-1)
    c = rms_norm(ops, c, w["self_attn.kv_a_layernorm.weight"], eps)
    k_pe = apply_rope(ops, ops.unsqueeze(k_pe, 1), cos, sin, rope)  # [B, 1, T, rope]
    latent_new = ops.concat([c, ops.reshape(k_pe, [0, -1, rope])], axis=-1)  # [B, T, 576]

    wkv = ops.reshape(kv_b_weight(ops, cfg, kind, w), [h, nope + vdim, lora])  # per head: W_uk rows, then W_uv
    if isinstance(latent_cache, PagedCache):  # the pool read in place: the MlaPaged* nodes
        parts = (q_nope, q_pe, latent_cache, latent_new, wkv)
        decompressed, absorbed = attend_paged_decompressed, attend_paged_absorbed
    else:
        parts = (q_nope, q_pe, latent_cache, latent_new, mask, wkv)
        decompressed, absorbed = attend_decompressed, attend_absorbed

    def decompress():  # on the step's shape: T, its new positions
        t = ops.dim(latent_new, 1)
        return ops.at_least(t, ops.const_like(decompress_from(cfg), t))

    o = ops.choose(decompress, lambda: decompressed(ops, cfg, *parts),
                   lambda: absorbed(ops, cfg, *parts))  # [B, H, T, v]
    o = ops.reshape(ops.transpose(o, [0, 2, 1, 3]), [0, 0, h * vdim])
    return lin(o, "self_attn.o_proj"), latent_new


def _probs(ops, cfg: K2Config, s_past, s_new, mask, latent_cache):
    """Scores against the past slots and the new entries (kept apart, so the past is never copied) -> the
    probabilities of each part, softmax in float32 over both, rounded to the activation dtype."""
    scores = ops.cast(ops.concat([s_past, s_new], axis=-1), F32) * cfg.softmax_scale + ops.unsqueeze(mask, 1)
    probs = ops.cast(ops.softmax(scores, axis=-1), "act")
    return ops.split_at(probs, ops.dim(latent_cache, 1), axis=-1)


def attend_absorbed(ops, cfg: K2Config, q_nope, q_pe, latent_cache, latent_new, mask, wkv):
    """Attention in latent space: W_uk turns q_nope into a latent query, scored against the cached rows as they
    are; the attended latent goes through W_uv. q_nope [B, H, T, nope], q_pe [B, H, T, rope] (rotated), wkv
    [H, nope + v, lora] -> [B, H, T, v]."""
    lora, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w_uk, w_uv = ops.split(wkv, [cfg.qk_nope_head_dim, cfg.v_head_dim], axis=1)  # [H, nope, L], [H, v, L]
    q_full = ops.concat([ops.matmul(q_nope, w_uk), q_pe], axis=-1)  # [B, H, T, L + rope]
    past = ops.unsqueeze(latent_cache, 1)  # [B, 1, P, 576]
    new = ops.unsqueeze(latent_new, 1)  # [B, 1, T, 576]
    s_past = ops.matmul(q_full, ops.transpose(past, [0, 1, 3, 2]))  # [B, H, T, P]
    s_new = ops.matmul(q_full, ops.transpose(new, [0, 1, 3, 2]))  # [B, H, T, T]
    p_past, p_new = _probs(ops, cfg, s_past, s_new, mask, latent_cache)
    # attend over the full 576-wide entries (no slice of the cache), then keep the latent part
    o_lat = ops.matmul(p_past, past) + ops.matmul(p_new, new)  # [B, H, T, 576]
    o_lat, _ = ops.split(o_lat, [lora, rope], axis=-1)
    return ops.matmul(o_lat, ops.transpose(w_uv, [0, 2, 1]))  # [B, H, T, v]


def attend_paged_decompressed(ops, cfg: K2Config, q_nope, q_pe, cache: PagedCache, latent_new, wkv):
    """attend_decompressed over a paged cache (the MlaPagedPrefill node). -> [B, H, T, v]."""
    h, vdim = cfg.num_attention_heads, cfg.v_head_dim
    q = ops.transpose(ops.concat([q_nope, q_pe], axis=-1), [0, 2, 1, 3])  # [B, T, H, nope + rope]
    kv_b = ops.reshape(wkv, [h * (cfg.qk_nope_head_dim + vdim), cfg.kv_lora_rank])
    o = ops.mla_paged_prefill(q, cache.pool, cache.page_table, cache.ctx_lens, latent_new, cache.n_new, kv_b,
                              cfg.softmax_scale, cache.page_tokens, cfg.kv_lora_rank, h, cfg.qk_nope_head_dim,
                              cfg.qk_rope_head_dim, vdim)  # [B, T, H, v]
    return ops.transpose(o, [0, 2, 1, 3])


def attend_paged_absorbed(ops, cfg: K2Config, q_nope, q_pe, cache: PagedCache, latent_new, wkv):
    """attend_absorbed over a paged cache: the MlaPagedDecode node (scores, softmax and weighted sum in float32);
    the attended latent goes through W_uv. -> [B, H, T, v]."""
    w_uk, w_uv = ops.split(wkv, [cfg.qk_nope_head_dim, cfg.v_head_dim], axis=1)
    q_full = ops.transpose(ops.concat([ops.matmul(q_nope, w_uk), q_pe], axis=-1), [0, 2, 1, 3])  # [B, T, H, 576]
    o_lat = ops.mla_paged_decode(q_full, cache.pool, cache.page_table, cache.ctx_lens, latent_new, cache.n_new,
                                 cfg.softmax_scale, cache.page_tokens, cfg.kv_lora_rank,
                                 cfg.num_attention_heads)  # [B, T, H, L]
    return ops.matmul(ops.transpose(o_lat, [0, 2, 1, 3]), ops.transpose(w_uv, [0, 2, 1]))  # [B, H, T, v]


def attend_decompressed(ops, cfg: K2Config, q_nope, q_pe, latent_cache, latent_new, mask, wkv):
    """Ordinary attention per head: every context position's latent through kv_b into its key (nope, beside the
    shared rope key) and value, as modeling_deepseek.py computes it. Same arguments and result as
    attend_absorbed. The keys are made transposed (W_uk · cᵀ), so the only tensors of heads × context size are
    the keys and values themselves."""
    rope = cfg.qk_rope_head_dim
    w_uk, w_uv = ops.split(wkv, [cfg.qk_nope_head_dim, cfg.v_head_dim], axis=1)  # [H, nope, L], [H, v, L]
    w_uv_t = ops.transpose(w_uv, [0, 2, 1])  # [H, L, v]

    def keys_values(entries):  # [B, S, 576] -> k_nopeᵀ [B, H, nope, S], k_peᵀ [B, 1, rope, S], v [B, H, S, v]
        c, k_pe = ops.split(entries, [cfg.kv_lora_rank, rope], axis=-1)
        c = ops.unsqueeze(c, 1)  # [B, 1, S, L]
        k_t = ops.matmul(w_uk, ops.transpose(c, [0, 1, 3, 2]))
        return k_t, ops.transpose(ops.unsqueeze(k_pe, 1), [0, 1, 3, 2]), ops.matmul(c, w_uv_t)

    def scores(k_t, pe_t):  # q · [k_nope, k_pe], the two parts summed in float32
        return ops.cast(ops.matmul(q_nope, k_t), F32) + ops.cast(ops.matmul(q_pe, pe_t), F32)

    k_past, pe_past, v_past = keys_values(latent_cache)
    k_new, pe_new, v_new = keys_values(latent_new)
    p_past, p_new = _probs(ops, cfg, scores(k_past, pe_past), scores(k_new, pe_new), mask, latent_cache)
    return ops.matmul(p_past, v_past) + ops.matmul(p_new, v_new)  # [B, H, T, v]


def swiglu(ops, cfg: K2Config, kind: str, x, w, prefix: str, activation_quant: int):
    """DeepseekV3MLP: down(silu(gate(x)) * up(x))."""
    g = linear(ops, cfg, kind, x, w, f"{prefix}.gate_proj", activation_quant)
    u = linear(ops, cfg, kind, x, w, f"{prefix}.up_proj", activation_quant)
    return linear(ops, cfg, kind, ops.silu(g) * u, w, f"{prefix}.down_proj", activation_quant)


def route(ops, cfg: K2Config, x, w):
    """MoEGate, noaux_tc: sigmoid scores; the bias only chooses; group-limited top-k; weights from the unbiased
    scores, normalized and scaled. x [B, T, d] -> (topk_ids [B, T, k] int64, topk_weights [B, T, k] float32)."""
    logits = ops.matmul(ops.cast(x, F32), ops.transpose(ops.cast(w["mlp.gate.weight"], F32), [1, 0]))
    scores = ops.sigmoid(logits)  # [B, T, E]
    choice = scores + w["mlp.gate.e_score_correction_bias"]
    if cfg.n_group > 1:
        e_per_group = cfg.n_routed_experts // cfg.n_group
        grouped = ops.reshape(choice, [0, 0, cfg.n_group, e_per_group])
        top2, _ = ops.topk(grouped, 2, axis=-1)
        group_scores = ops.reduce_sum(top2, axis=-1, keepdims=False)  # [B, T, G]
        _, group_idx = ops.topk(group_scores, cfg.topk_group, axis=-1)
        ones = ops.cast(group_idx, F32) * 0.0 + 1.0
        group_mask = ops.scatter_elements(ops.zeros_like(group_scores), group_idx, ones, axis=-1)  # [B, T, G]
        # masked_fill(~mask, 0.0) over the experts of the groups not kept
        choice = ops.reshape(grouped * ops.unsqueeze(group_mask, -1), [0, 0, cfg.n_routed_experts])
    _, topk_ids = ops.topk(choice, cfg.num_experts_per_tok, axis=-1)
    weights = ops.gather_elements(scores, topk_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (ops.reduce_sum(weights, axis=-1) + 1e-20)
    return topk_ids, weights * cfg.routed_scaling_factor


def routed_experts(ops, cfg: K2Config, x, topk_ids, topk_weights, w, activation_quant: int):
    """The routed experts as one node: MoeFp8 for FP8 block experts, MoeInt4 for INT4 pack-quantized ones."""
    fmt = experts_format(cfg)
    e = "mlp.experts."
    if fmt.kind == FP8_BLOCK:
        return ops.moe_fp8(x, topk_ids, topk_weights,
                           *(w[f"{e}{p}.{t}"] for p in ("gate_proj", "up_proj", "down_proj")
                             for t in ("weight", "weight_scale_inv")), activation_quant)
    return ops.moe_int4(x, topk_ids, topk_weights,
                        *(w[f"{e}{p}.{t}"] for p in ("gate_proj", "up_proj", "down_proj")
                          for t in ("weight_packed", "weight_scale")), fmt.group_size)


def moe(ops, cfg: K2Config, x, w, activation_quant: int):
    """DeepseekV3MoE: routed experts (one MoeFp8 / MoeInt4 node) plus the shared expert."""
    topk_ids, topk_weights = route(ops, cfg, x, w)
    routed = routed_experts(ops, cfg, x, ops.cast(topk_ids, "int32"), topk_weights, w, activation_quant)
    return routed + swiglu(ops, cfg, "moe_block", x, w, "mlp.shared_experts", activation_quant)


# ---- a MoE block split at the dispatch (expert parallelism) ------------------------------------------------
# Each expert-parallel rank runs the front for its own tokens, sends each (token, expert) pair's moe_input row to
# the rank owning the expert, runs local_experts over the rows it received, and combines the k outputs it gets
# back for each of its tokens (runtime/distributed/expert_parallel.py): the same sums, in the same order, as
# decoder_block's one graph.

def moe_front(ops, cfg: K2Config, hidden, rope_cos, rope_sin, mask, latent_cache, w, activation_quant: int):
    """A MoE block up to the dispatch: attention and its residual, the post-attention norm, the router and the
    shared expert. -> (residual, moe_input, topk_ids int32 [B, T, k], topk_weights float32 [B, T, k], shared_out,
    latent_new)."""
    residual, latent_new = _attend(ops, cfg, "moe_block", hidden, rope_cos, rope_sin, mask, latent_cache, w,
                                   activation_quant)
    x = rms_norm(ops, residual, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    topk_ids, topk_weights = route(ops, cfg, x, w)
    shared = swiglu(ops, cfg, "moe_block", x, w, "mlp.shared_experts", activation_quant)
    return residual, x, ops.cast(topk_ids, "int32"), topk_weights, shared, latent_new


def local_experts(ops, cfg: K2Config, rows, expert_ids, w, activation_quant: int):
    """One rank's routed experts over the (token, expert) pairs dispatched to it: rows [R, d] (each pair's
    moe_input row), expert_ids int32 [R] (the pair's expert among the rank's, 0 <= id < E/ep) -> expert_out
    [R, d], each row its expert's output alone (weight 1: the weighting is the combine's). The same routed-experts
    node as the whole block, one pair per row."""
    x = ops.unsqueeze(rows, 1)  # [R, 1, d]: R "tokens" of one position, top-1
    ids = ops.reshape(expert_ids, [-1, 1, 1])
    ones = ops.cast(ids, F32) * 0.0 + 1.0
    y = routed_experts(ops, cfg, x, ids, ones, w, activation_quant)
    return ops.reshape(y, [-1, cfg.hidden_size])


def moe_combine(ops, pair_out, topk_weights, shared, residual):
    """The block's output on the tokens' own rank: pair_out [B·T·k, d] (pair t·k + j: token t's j-th expert
    output) weighted and summed in float32 in j order, as the routed-experts node's last stage sums them, then the
    shared expert and the residual added as decoder_block adds them."""
    return residual + (ops.moe_combine(pair_out, topk_weights) + shared)


def _attend(ops, cfg: K2Config, kind: str, hidden, rope_cos, rope_sin, mask, latent_cache, w, activation_quant: int):
    """Pre-norm attention with its residual: -> (hidden + attention, latent_new)."""
    a, latent_new = attention(ops, cfg, kind, rms_norm(ops, hidden, w["input_layernorm.weight"], cfg.rms_norm_eps),
                              rope_cos, rope_sin, mask, latent_cache, w, activation_quant)
    return hidden + a, latent_new


def decoder_block(ops, cfg: K2Config, kind: str, hidden, rope_cos, rope_sin, mask, latent_cache, w,
                  activation_quant: int):
    """DeepseekV3DecoderLayer: pre-norm attention and FFN with residuals. kind: dense_block | moe_block."""
    eps = cfg.rms_norm_eps
    hidden, latent_new = _attend(ops, cfg, kind, hidden, rope_cos, rope_sin, mask, latent_cache, w, activation_quant)
    h = rms_norm(ops, hidden, w["post_attention_layernorm.weight"], eps)
    if kind == "moe_block":
        m = moe(ops, cfg, h, w, activation_quant)
    elif kind == "dense_block":
        m = swiglu(ops, cfg, kind, h, w, "mlp", activation_quant)
    else:
        raise ValueError(f"unknown block kind {kind!r}")
    return hidden + m, latent_new


def embedding(ops, input_ids, w):
    return ops.cast(ops.gather_rows(w["model.embed_tokens.weight"], input_ids), "act")


def head(ops, cfg: K2Config, hidden, w):
    """Final RMSNorm, untied lm_head, logits in float32."""
    h = rms_norm(ops, hidden, w["model.norm.weight"], cfg.rms_norm_eps)
    return ops.cast(ops.linear(h, w["lm_head.weight"]), F32)
