"""The torch reference: every backend is judged against it.

`ReferenceModel` runs the block functions of graphs/blocks.py eagerly (TorchOps), one layer at a time, with
weights from a checkpoint. `forward_full` is an independent, HF-literal forward (expanded attention, no cache)
used to check the absorbed latent-cache path; `greedy_generate` decodes with the latent cache.
On CPU everything computes in float32 (bf16 matmuls are very slow there).
"""

from __future__ import annotations

import torch

from k2trt.config import K2Config
from k2trt.graphs import blocks
from k2trt.graphs.fp8 import WEIGHT_DEQUANT
from k2trt.graphs.mask import attention_mask, simple_mask
from k2trt.graphs.ops import TorchOps
from k2trt.graphs.rope import rope_tables
from k2trt.graphs.weights import as_graph_input, embedding_weight_specs, head_weight_specs


def to_compute(w: dict, act: torch.dtype) -> dict:
    """Checkpoint tensors in the dtypes the graphs take them in (bf16 -> the activation dtype)."""
    return {k: as_graph_input(v, act) for k, v in w.items()}


class ReferenceModel:
    """embed / block / head on torch tensors: the same interface the runtime's backends expose.

    `weights` is a weight source (runtime/backend.WeightSource): a Checkpoint, or random weights in tests. Each
    layer's weights are read on first use; the embedding and head weights too, so a model that runs only some
    layers (a pipeline stage) reads only those.
    """

    def __init__(self, weights, act_dtype: str = "float32", activation_quant: int = WEIGHT_DEQUANT,
                 cache_weights: bool = True):
        self.weights = weights
        self.cfg: K2Config = weights.config
        self.ops = TorchOps(act_dtype)
        self.activation_quant = activation_quant
        self._cache_weights = cache_weights
        self._layer_w: dict[int, dict] = {}
        self._global_w: dict = {}
        self.global_names = {"embedding": [s.name for s in embedding_weight_specs(self.cfg)],
                             "head": [s.name for s in head_weight_specs(self.cfg)]}

    def _globals(self, *names: str) -> dict:
        """The named global tensors, read on first use (a pipeline stage reads only its own)."""
        missing = [n for n in names if n not in self._global_w]
        if missing:
            self._global_w.update(to_compute(self.weights.globals(missing), self.ops.act))
        return self._global_w

    def layer_weights(self, layer: int) -> dict:
        if layer in self._layer_w:
            return self._layer_w[layer]
        w = to_compute(self.weights.block_weights(layer), self.ops.act)
        if self._cache_weights:
            self._layer_w[layer] = w
        return w

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return blocks.embedding(self.ops, input_ids, self._globals(*self.global_names["embedding"]))

    @torch.no_grad()
    def block(self, layer: int, hidden, rope_cos, rope_sin, mask, latent_cache):
        kind = self.cfg.layer_kind(layer)
        return blocks.decoder_block(self.ops, self.cfg, kind, hidden, rope_cos.to(self.ops.act),
                                    rope_sin.to(self.ops.act), mask, latent_cache,
                                    self.layer_weights(layer), self.activation_quant)

    @torch.no_grad()
    def head(self, hidden):
        return blocks.head(self.ops, self.cfg, hidden, self._globals(*self.global_names["head"]))

    # ---- a MoE block split at the dispatch (expert parallelism; the weights hold one rank's experts) ------------
    @torch.no_grad()
    def moe_front(self, layer: int, hidden, rope_cos, rope_sin, mask, latent_cache):
        return blocks.moe_front(self.ops, self.cfg, hidden, rope_cos.to(self.ops.act), rope_sin.to(self.ops.act),
                                mask, latent_cache, self.layer_weights(layer), self.activation_quant)

    @torch.no_grad()
    def moe_experts(self, layer: int, rows, expert_ids, decode: bool = False):
        return blocks.local_experts(self.ops, self.cfg, rows, expert_ids, self.layer_weights(layer),
                                    self.activation_quant)

    @torch.no_grad()
    def moe_combine(self, layer: int, pair_out, topk_weights, shared_out, residual):
        return blocks.moe_combine(self.ops, pair_out, topk_weights, shared_out, residual)

    # ---- whole-model conveniences -----------------------------------------------------------------
    @torch.no_grad()
    def forward_cached(self, input_ids, positions, mask, caches):
        """One step through every layer. caches: per-layer [B, P, latent] tensors (read only).
        Returns (logits [B, T, V], per-layer new entries [B, T, latent])."""
        cos, sin = rope_tables(self.cfg, positions)
        h = self.embed(input_ids)
        news = []
        for layer in range(self.cfg.num_hidden_layers):
            h, new = self.block(layer, h, cos, sin, mask, caches[layer])
            news.append(new)
        return self.head(h), news

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """HF-literal forward over a whole sequence: expanded attention, no cache. -> logits [B, T, V]."""
        cfg, ops = self.cfg, self.ops
        b, t = input_ids.shape
        positions = torch.arange(t).expand(b, t)
        cos, sin = rope_tables(cfg, positions)
        mask = simple_mask(b, 0, t)
        h = self.embed(input_ids)
        for layer in range(cfg.num_hidden_layers):
            w = self.layer_weights(layer)
            kind = cfg.layer_kind(layer)
            x = blocks.rms_norm(ops, h, w["input_layernorm.weight"], cfg.rms_norm_eps)
            h = h + attention_expanded(ops, cfg, kind, x, cos.to(ops.act), sin.to(ops.act), mask, w,
                                       self.activation_quant)
            x = blocks.rms_norm(ops, h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
            if kind == "moe_block":
                h = h + blocks.moe(ops, cfg, x, w, self.activation_quant)
            else:
                h = h + blocks.swiglu(ops, cfg, kind, x, w, "mlp", self.activation_quant)
        return self.head(h)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary(x, cos_half, sin_half):
    """apply_rotary_pos_emb of modeling_deepseek.py: permute interleaved pairs to halves, then rotate_half."""
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    cos = torch.cat([cos_half, cos_half], dim=-1)
    sin = torch.cat([sin_half, sin_half], dim=-1)
    return x * cos + _rotate_half(x) * sin


def attention_expanded(ops, cfg: K2Config, kind: str, x, cos, sin, mask, w, activation_quant: int):
    """DeepseekV3Attention.forward without a cache, literally: kv_b expands the latent into per-head keys and
    values, then ordinary multi-head attention. x [B, S, d]; cos/sin [B, S, rope/2]; mask [B, S, S]."""
    b, s, _ = x.shape
    h, nope, rope, vdim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lin = lambda t, name: blocks.linear(ops, cfg, kind, t, w, name, activation_quant)  # noqa: E731
    q = lin(blocks.rms_norm(ops, lin(x, "self_attn.q_a_proj"), w["self_attn.q_a_layernorm.weight"],
                            cfg.rms_norm_eps), "self_attn.q_b_proj")
    q = q.view(b, s, h, nope + rope).transpose(1, 2)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    ckv = lin(x, "self_attn.kv_a_proj_with_mqa")
    c, k_pe = ckv.split([cfg.kv_lora_rank, rope], dim=-1)
    k_pe = k_pe.view(b, s, 1, rope).transpose(1, 2)
    kv = lin(blocks.rms_norm(ops, c, w["self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps), "self_attn.kv_b_proj")
    kv = kv.view(b, s, h, nope + vdim).transpose(1, 2)
    k_nope, v = kv.split([nope, vdim], dim=-1)
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    q_pe = hf_apply_rotary(q_pe, cos4, sin4)
    k_pe = hf_apply_rotary(k_pe, cos4, sin4)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(b, h, s, rope)], dim=-1)
    scores = (q @ k.transpose(2, 3)) * cfg.softmax_scale + mask.unsqueeze(1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = (probs @ v).transpose(1, 2).reshape(b, s, h * vdim)
    return lin(o, "self_attn.o_proj")


@torch.no_grad()
def greedy_generate(model: ReferenceModel, prompt_ids: list[int], max_new_tokens: int,
                    stop_ids: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
    """Batch-1 greedy decoding with a preallocated latent cache per layer.
    Returns (new token ids, first-step logits [V])."""
    cfg = model.cfg
    n = len(prompt_ids)
    capacity = n + max_new_tokens
    caches = [torch.zeros(1, capacity, cfg.latent_dim, dtype=model.ops.act) for _ in range(cfg.num_hidden_layers)]
    key_pos = torch.arange(capacity).unsqueeze(0)
    ids = torch.tensor([prompt_ids])
    past, out, first_logits = 0, [], None
    while len(out) < max_new_tokens:
        t = ids.shape[1]
        q_pos = torch.arange(past, past + t).unsqueeze(0)
        # keys: every cache slot (valid below `past`), then the t new positions
        k_pos = torch.cat([key_pos, q_pos], dim=1)
        valid = torch.cat([key_pos < past, torch.ones(1, t, dtype=torch.bool)], dim=1)
        logits, news = model.forward_cached(ids, q_pos, attention_mask(q_pos, k_pos, valid), caches)
        for cache, new in zip(caches, news):
            cache[:, past:past + t] = new
        past += t
        last = logits[0, -1]
        if first_logits is None:
            first_logits = last.clone()
        nxt = int(last.argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        ids = torch.tensor([[nxt]])
    return out, first_logits
