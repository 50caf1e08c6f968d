"""EAGLE-3 drafts of the K2 family as they are published, read into one form.

Three ways a draft's config.json describes it, two layouts of its one decoder layer:
  * "eagle3" with `architectures: ["LlamaForCausalLMEagle3"]` (AQ-MedAI/Kimi-K2-Instruct-eagle3, lightseekorg's
    kimi-k2.x-eagle3): a Llama layer — q/k/v/o projections, SwiGLU MLP;
  * "eagle3" with `architectures: ["Eagle3DeepseekV2ForCausalLM"]` (k-l-lambda/Kimi-K2.5-Eagle3, the -mla drafts):
    an MLA layer — q_a/q_b, kv_a_proj_with_mqa, kv_b, o — in the target's latent layout;
  * "speculators" (vLLM's speculators format: `speculators_model_type: "eagle3"`, the Llama layer's config in
    `transformer_layer_config`).
Whatever the source, the tensors are named as `layers.0.*` (`midlayer.*` is its other spelling), beside `fc`
[hidden, 3 × target hidden] over the target's residual stream at three depths, `norm`, `lm_head` [draft vocab,
hidden] (never shared), `d2t` [draft vocab] (an offset: target id = draft id + d2t[draft id]; absent when the draft
speaks the target's whole vocabulary), and `embed_tokens` (absent: the target's embedding is shared). The layer's
first projections read concat(input_layernorm(embed(token)), hidden_norm(hidden)): 2 × hidden inputs.

The aux ids — which residual-stream tensors `fc` reads — come in two conventions: "input to layer i" (vLLM's, as
written: [2, 30, 58] for K2's 61 layers) and "output of layer i" ([1, 29, 57]), the same tensors. Checkpoints do not
say which; as SGLang decides, a list whose first id is 1 is taken as layer outputs and moved up by one.
`DraftConfig.aux_layer_ids` is always "the residual stream entering layer i" (`aux_ids_as_written` keeps the file's).
Absent, they are vLLM's default for the target: (2, n // 2, n − 3).

Every damaged or unsupported draft is one line (DraftError) naming the file and the field or tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.files import read_json_object
from k2trt.safetensors_io import SafetensorsFile

LAYOUTS = ("llama", "mla")
SOURCE_FORMATS = ("eagle3", "speculators")
ARCHITECTURES = {"LlamaForCausalLMEagle3": "llama", "Eagle3DeepseekV2ForCausalLM": "mla",
                 "Eagle3Speculator": "llama"}
LAYER = "layers.0."
LAYER_SPELLINGS = ("midlayer.", "model.layers.0.", "layers.0.")  # as files name the one decoder layer
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    else:
        archs = raw.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch not in ARCHITECTURES:
            raise DraftError(f"{where}: architectures {archs!r} is not an EAGLE-3 draft (expected one of "
                             f"{', '.join(ARCHITECTURES)}, or the speculators format)")
        source, layout, body = "eagle3", ARCHITECTURES[arch], raw
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
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
        aux_layer_ids=ids, aux_ids_as_written=written,
        rms_norm_eps=_float(body, "rms_norm_eps", where, 1e-6), rope_theta=_float(body, "rope_theta", where, 1e4),
        norm_before_residual=bool(body.get("norm_before_residual", False)))
    if layout == "llama":
        cfg = DraftConfig(**common, num_key_value_heads=_int(body, "num_key_value_heads", where, heads),
                          head_dim=_int(body, "head_dim", where, hidden // heads))
    else:
        q_lora = body.get("q_lora_rank")
        cfg = DraftConfig(**common, q_lora_rank=None if q_lora is None else _int(body, "q_lora_rank", where),
                          kv_lora_rank=_int(body, "kv_lora_rank", where),
                          qk_rope_head_dim=_int(body, "qk_rope_head_dim", where),
                          qk_nope_head_dim=_int(body, "qk_nope_head_dim", where),
                          v_head_dim=_int(body, "v_head_dim", where))
    check_against_target(cfg, target, where)
    return cfg


def check_against_target(cfg: DraftConfig, target: K2Config, where: str) -> None:
    if cfg.target_hidden_size != target.hidden_size:
        raise DraftError(f"{where}: the draft reads a target of hidden size {cfg.target_hidden_size}, the model's is "
                         f"{target.hidden_size} (a draft for another model?)")
    if cfg.vocab_size != target.vocab_size:
        raise DraftError(f"{where}: vocab_size {cfg.vocab_size} differs from the model's {target.vocab_size}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise DraftError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")


@dataclass
class Draft:
    """A loaded draft: its config, its tensors by normalized name (float ones as stored), the target ids of its
    vocabulary (int64 [draft vocab]), and whether it shares the target's embedding."""
    config: DraftConfig
    root: Path
    tensors: dict[str, torch.Tensor]
    target_ids: torch.Tensor

    @property
    def shares_embedding(self) -> bool:
        return "embed_tokens.weight" not in self.tensors


def _normalized(name: str) -> str:
    for spelling in LAYER_SPELLINGS:
        if name.startswith(spelling):
            return LAYER + name[len(spelling):]
    return name[len("model."):] if name.startswith("model.") else name


def _files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise DraftError(f"{root}: no .safetensors file (a draft checkpoint holds its weights in one)")
    return files


def load_draft(path: str | Path, target: K2Config) -> Draft:
    """A draft checkpoint directory (or owner/name from the Hugging Face cache: k2trt.hub) for `target`, every
    tensor checked against its config; DraftError otherwise."""
    from k2trt.hub import resolve_model

    root = resolve_model(str(path))
    if not root.is_dir():
        raise DraftError(f"{root}: not a draft checkpoint directory")
    cfg = parse_draft_config(read_json_object(root / "config.json", "a draft checkpoint needs its config",
                                              DraftError), str(root / "config.json"), target)
    tensors: dict[str, torch.Tensor] = {}
    for file in _files(root):
        try:
            st = SafetensorsFile(file)
        except K2Error as e:  # a damaged file: the reader's one line, as the draft's
            raise DraftError(str(e)) from None
        for name in st.names():
            key = _normalized(name)
            if key.endswith(("weight_scale_inv", "weight_scale", "weight_packed")):
                raise DraftError(f"{file}: {name} is a quantized tensor; k2trt runs bf16 drafts")
            if key in tensors:
                raise DraftError(f"{file}: {name} is stored twice (as {key})")
            tensors[key] = st.tensor(name)
    _check_tensors(cfg, root, tensors)
    target_ids = _target_ids(cfg, root, tensors)
    return Draft(cfg, root, tensors, target_ids)


def _check_tensors(cfg: DraftConfig, root: Path, tensors: dict[str, torch.Tensor]) -> None:
    for name, shape in cfg.tensor_shapes().items():
        t = tensors.get(name)
        if t is None:
            raise DraftError(f"{root}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise DraftError(f"{root}: tensor {name} is {list(t.shape)}, the config says {list(shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise DraftError(f"{root}: tensor {name} is {t.dtype}, expected bfloat16, float16 or float32")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftError(f"{root}: tensor embed_tokens.weight is {list(embed.shape)}, expected "
                         f"{[cfg.vocab_size, cfg.hidden_size]}")
    if embed is None and cfg.hidden_size != cfg.target_hidden_size:
        raise DraftError(f"{root}: no embed_tokens.weight, and the target's embedding ({cfg.target_hidden_size} "
                         f"wide) cannot be shared with a draft {cfg.hidden_size} wide")
    for i in range(3):
        norm = tensors.get(f"fc_norm.{i}.weight")  # EAGLE3.1: one RMSNorm per aux chunk
        if norm is not None and tuple(norm.shape) != (cfg.target_hidden_size,):
            raise DraftError(f"{root}: tensor fc_norm.{i}.weight is {list(norm.shape)}, expected "
                             f"[{cfg.target_hidden_size}]")


def _target_ids(cfg: DraftConfig, root: Path, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target id of each draft id: draft id + d2t[draft id]; the identity for a draft of the whole vocabulary."""
    d2t = tensors.get("d2t")
    ids = torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DraftError(f"{root}: no d2t, but draft_vocab_size {cfg.draft_vocab_size} is not the vocabulary's "
                             f"{cfg.vocab_size} (d2t maps draft ids to target ids)")
        return ids
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise DraftError(f"{root}: tensor d2t is {d2t.dtype} {list(d2t.shape)}, expected integers "
                         f"[{cfg.draft_vocab_size}]")
    target = ids + d2t.to(torch.int64)
    if int(target.min()) < 0 or int(target.max()) >= cfg.vocab_size:
        raise DraftError(f"{root}: d2t maps draft ids outside the vocabulary 0..{cfg.vocab_size - 1}")
    if torch.unique(target).numel() != target.numel():
        raise DraftError(f"{root}: d2t maps two draft ids to the same target id")
    return target
