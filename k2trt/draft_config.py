"""An EAGLE-3 draft's config.json, in any of its published forms, read into one DraftConfig for a target (the
checkpoint's tensors are k2trt/draft.py's): the module docstring there says what the forms are and how the aux-layer
ids are normalized."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from k2trt.config import K2Config
from k2trt.errors import K2Error

LAYOUTS = ("llama", "mla")
SOURCE_FORMATS = ("eagle3", "speculators")
ARCHITECTURES = {"LlamaForCausalLMEagle3": "llama", "Eagle3DeepseekV2ForCausalLM": "mla",
                 "Eagle3Speculator": "llama"}
LAYER = "layers.0."


class DraftError(K2Error):
    """A draft checkpoint k2trt cannot use: one line naming what is wrong."""


@dataclass(frozen=True)
class DraftConfig:
    layout: str  # "llama" | "mla"
    source_format: str  # "eagle3" | "speculators"
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int  # the target's vocabulary: embed_tokens' rows, and what d2t maps into
    draft_vocab_size: int  # lm_head's rows
    aux_layer_ids: tuple[int, ...]  # normalized: the residual stream entering these target layers
    aux_ids_as_written: tuple[int, ...] | None  # None: absent from config.json (the default applied)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_before_residual: bool = False
    # llama layout
    num_key_value_heads: int = 0
    head_dim: int = 0
    # mla layout
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_scaling: dict | None = None  # mla: as config.json gives it (DeepSeek's YaRN), None: plain rotary
    max_position_embeddings: int = 0
    speculative_tokens: int | None = None  # the k a speculators draft was made for (vLLM's default for it)

    def attention_config(self, target: K2Config) -> K2Config:
        """The MLA layout's attention as a K2Config of its own (bf16, one dense layer, the draft's widths and
        rotary), so graphs/blocks.attention — the target's MLA — computes it; its input is 2 × hidden wide."""
        raw = {k: v for k, v in target.to_hf_dict().items() if k not in ("quantization_config", "rope_scaling")}
        raw.update(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=1,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_attention_heads,
                   q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                   qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                   v_head_dim=self.v_head_dim, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                   first_k_dense_replace=1, rope_scaling=self.rope_scaling,
                   max_position_embeddings=self.max_position_embeddings or target.max_position_embeddings)
        return K2Config.from_hf_dict(raw, "the draft's attention (config.json)")

    def fingerprint(self) -> str:
        """A short hash of every field but the suggested k: a draft's exported graphs record it (they depend on
        nothing else of it)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "speculative_tokens"}
        blob = json.dumps(fields, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a draft of this config must hold (names as normalized), and its shape."""
        h, i, n = self.hidden_size, self.intermediate_size, self.num_attention_heads
        shapes = {"fc.weight": (h, 3 * self.target_hidden_size), "norm.weight": (h,),
                  "lm_head.weight": (self.draft_vocab_size, h),
                  LAYER + "hidden_norm.weight": (h,), LAYER + "input_layernorm.weight": (h,),
                  LAYER + "post_attention_layernorm.weight": (h,),
                  LAYER + "mlp.gate_proj.weight": (i, h), LAYER + "mlp.up_proj.weight": (i, h),
                  LAYER + "mlp.down_proj.weight": (h, i)}
        attn = LAYER + "self_attn."
        if self.layout == "llama":
            q, kv = n * self.head_dim, self.num_key_value_heads * self.head_dim
            shapes.update({attn + "q_proj.weight": (q, 2 * h), attn + "k_proj.weight": (kv, 2 * h),
                           attn + "v_proj.weight": (kv, 2 * h), attn + "o_proj.weight": (h, q)})
        else:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                shapes.update({attn + "q_a_proj.weight": (self.q_lora_rank, 2 * h),
                               attn + "q_a_layernorm.weight": (self.q_lora_rank,),
                               attn + "q_b_proj.weight": (n * qk, self.q_lora_rank)})
            else:
                shapes[attn + "q_proj.weight"] = (n * qk, 2 * h)
            shapes.update({
                attn + "kv_a_proj_with_mqa.weight": (self.kv_lora_rank + self.qk_rope_head_dim, 2 * h),
                attn + "kv_a_layernorm.weight": (self.kv_lora_rank,),
                attn + "kv_b_proj.weight": (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                attn + "o_proj.weight": (h, n * self.v_head_dim)})
        return shapes


def _int(raw: dict, key: str, where: str, default: Any = None, low: int = 1) -> int:
    value = raw.get(key, default)
    if value is None:
        raise DraftError(f"{where}: {key} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise DraftError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def _float(raw: dict, key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise DraftError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _aux_ids(raw_ids, where: str, target: K2Config) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(normalized, as written). The convention rule is the module docstring's."""
    n = target.num_hidden_layers
    if raw_ids is None:
        return (2, n // 2, n - 3), None
    if not isinstance(raw_ids, list) or not raw_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in raw_ids):
        raise DraftError(f"{where}: eagle_aux_hidden_state_layer_ids must be a non-empty list of integers, "
                         f"got {raw_ids!r}")
    written = tuple(raw_ids)
    ids = tuple(i + 1 for i in written) if written[0] == 1 else written  # layer outputs -> the next layer's input
    bad = [i for i in ids if not 1 <= i <= n - 1]
    if bad:
        raise DraftError(f"{where}: aux layer ids {list(written)} name layers outside the target's 1..{n - 1} "
                         f"(as inputs to layers: {list(ids)})")
    return ids, written


MAX_SPECULATIVE_TOKENS = 16  # the most draft tokens a step proposes (--speculative-config's k)


def _speculative_tokens(config, where: str) -> int | None:
    """The k a speculators draft names (speculators_config.proposal_methods[0].speculative_tokens), or None."""
    methods = config.get("proposal_methods") if isinstance(config, dict) else None
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        return None
    k = methods[0].get("speculative_tokens")
    if k is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise DraftError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens must be 1.."
                         f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return k


def parse_draft_config(raw: dict, where: str, target: K2Config) -> DraftConfig:
    """A draft's config.json (any of the three forms) for `target`; DraftError names the field at fault."""
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise DraftError(f"{where}: speculators_model_type {raw['speculators_model_type']!r} is not eagle3 "
                             "(the only speculators draft k2trt runs)")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise DraftError(f"{where}: transformer_layer_config (the draft layer's Llama config) is missing")
        source, layout, body = "speculators", "llama", {**layer, **{k: v for k, v in raw.items()
                                                                 if k != "transformer_layer_config"}}
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        k = _speculative_tokens(raw.get("speculators_config"), where)
    else:
        archs = raw.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in ARCHITECTURES:
            raise DraftError(f"{where}: architectures {archs!r} is not an EAGLE-3 draft (expected one of "
                             f"{', '.join(ARCHITECTURES)}, or the speculators format)")
        source, layout, body = "eagle3", ARCHITECTURES[arch], raw
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        k = None
    if body.get("quantization_config") is not None:
        raise DraftError(f"{where}: quantized drafts are not supported (quantization_config is set); use a bf16 "
                         "draft")
    hidden = _int(body, "hidden_size", where)
    heads = _int(body, "num_attention_heads", where)
    vocab = _int(body, "vocab_size", where, target.vocab_size)
    ids, written = _aux_ids(aux, where, target)
    common = dict(
        layout=layout, source_format=source, hidden_size=hidden,
        target_hidden_size=_int(body, "target_hidden_size", where, hidden),
        intermediate_size=_int(body, "intermediate_size", where), num_attention_heads=heads,
        vocab_size=vocab, draft_vocab_size=_int(body, "draft_vocab_size", where, vocab),
        aux_layer_ids=ids, aux_ids_as_written=written, speculative_tokens=k,
        rms_norm_eps=_float(body, "rms_norm_eps", where, 1e-6), rope_theta=_float(body, "rope_theta", where, 1e4),
        norm_before_residual=bool(body.get("norm_before_residual", False)))
    if layout == "llama":
        cfg = DraftConfig(**common, num_key_value_heads=_int(body, "num_key_value_heads", where, heads),
                          head_dim=_int(body, "head_dim", where, hidden // heads))
    else:
        q_lora = body.get("q_lora_rank")
        scaling = body.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise DraftError(f"{where}: rope_scaling must be an object, got {scaling!r}")
        cfg = DraftConfig(**common, q_lora_rank=None if q_lora is None else _int(body, "q_lora_rank", where),
                          rope_scaling=scaling,
                          max_position_embeddings=_int(body, "max_position_embeddings", where,
                                                       target.max_position_embeddings),
                          kv_lora_rank=_int(body, "kv_lora_rank", where),
                          qk_rope_head_dim=_int(body, "qk_rope_head_dim", where),
                          qk_nope_head_dim=_int(body, "qk_nope_head_dim", where),
                          v_head_dim=_int(body, "v_head_dim", where))
    check_against_target(cfg, target, where)
    if layout == "mla":
        if cfg.q_lora_rank is None:
            raise DraftError(f"{where}: an MLA draft without q_lora_rank is not supported yet (K2's drafts have one)")
        try:
            cfg.attention_config(target)
        except K2Error as e:
            raise DraftError(f"{where}: {e}") from None
    return cfg


def check_against_target(cfg: DraftConfig, target: K2Config, where: str) -> None:
    if cfg.target_hidden_size != target.hidden_size:
        raise DraftError(f"{where}: the draft reads a target of hidden size {cfg.target_hidden_size}, the model's is "
                         f"{target.hidden_size} (a draft for another model?)")
    if cfg.vocab_size != target.vocab_size:
        raise DraftError(f"{where}: vocab_size {cfg.vocab_size} differs from the model's {target.vocab_size}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise DraftError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
