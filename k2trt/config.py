"""The K2 model config: one dataclass, read from an HF `config.json` (model_type kimi_k2 or deepseek_v3).

Every shape in the project is derived from this class; nothing else hard-codes K2's dimensions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2trt.errors import K2Error
from k2trt.files import read_json_object
from k2trt.quantization import Quantization, QuantizationError, parse_quantization


class ConfigError(K2Error, ValueError):
    """A config.json that is missing a field, has an unknown value, or contradicts itself."""


SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")

# How a release lays the text model out: K2 and K2-Thinking are DeepseekV3ForCausalLM at the top of config.json and
# of the tensor names; K2.5 and K2.6 nest it in a vision-language model (`text_config`, tensors under
# `language_model.`, beside a vision tower k2trt never loads). layout -> (config.json wrapper, tensor name prefix).
LAYOUTS = {"k2": None, "k2.5": ("kimi_k25", "KimiK25ForConditionalGeneration", "language_model.")}

# The block kinds: one graph (and one engine) each; K2Config.layer_kind names a layer's.
BLOCK_KINDS = ("embedding", "dense_block", "moe_block", "head")
# Each kind's activation inputs and outputs, in the order of the Backend interface (runtime/backends/contract.py).
BLOCK_ACTIVATIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "embedding": (("input_ids",), ("hidden_states",)),
    "dense_block": (("hidden_states", "rope_cos", "rope_sin", "attention_mask", "latent_cache"),
                    ("hidden_states_out", "latent_new")),
    "moe_block": (("hidden_states", "rope_cos", "rope_sin", "attention_mask", "latent_cache"),
                  ("hidden_states_out", "latent_new")),
    "head": (("hidden_states",), ("logits",)),
    # a MoE block split at the dispatch, for expert parallelism (graphs/blocks.py moe_front, local_experts,
    # moe_combine): attention + router + shared expert; one rank's routed experts over the rows dispatched to it;
    # the combine on the tokens' own rank
    "moe_front": (("hidden_states", "rope_cos", "rope_sin", "attention_mask", "latent_cache"),
                  ("residual", "moe_input", "topk_ids", "topk_weights", "shared_out", "latent_new")),
    "moe_experts": (("expert_rows", "expert_ids"), ("expert_out",)),
    "moe_combine": (("pair_out", "topk_weights", "shared_out", "residual"), ("hidden_states_out",)),
}
# The MoE block's parts under expert parallelism: exported (and built) besides the block kinds by
# `k2trt export --expert-parallel E`, whose E fixes the experts graph's expert count.
MOE_PART_KINDS = ("moe_front", "moe_experts", "moe_combine")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_scaling` in config.json)."""

    type: str = "yarn"
    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 1.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class K2Config:
    model_type: str = "kimi_k2"
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    rope_theta: float = 50000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 163584
    eos_token_id: int = 163585
    torch_dtype: str = "bfloat16"
    # not HF fields of the text config: how the checkpoint stores the model (see LAYOUTS, k2trt/quantization.py)
    layout: str = "k2"
    quantization: Quantization = field(default_factory=Quantization)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def weight_prefix(self) -> str:
        """What the checkpoint puts before every text-model tensor name ("language_model." in K2.5)."""
        wrapper = LAYOUTS[self.layout]
        return wrapper[2] if wrapper else ""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the normalized latent plus the rope key (576 for K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        # modeling_deepseek.py 1152-1160
        return (
            self.n_routed_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def layer_kind(self, layer: int) -> str:
        return "moe_block" if self.is_moe_layer(layer) else "dense_block"

    @property
    def softmax_scale(self) -> float:
        """`q_head_dim^-0.5`, times mscale² under YaRN (modeling_deepseek.py DeepseekV3Attention)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def fingerprint(self) -> str:
        """A short hash of every field: graphs and engines record it and refuse a different config."""
        blob = json.dumps(self.to_hf_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- HF config.json -----------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("layout", "quantization")}
        d["rope_scaling"] = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        q = self.quantization.to_hf_dict()
        if q is not None:
            d["quantization_config"] = q
        d["hidden_act"] = "silu"
        d["ep_size"] = 1
        d["use_cache"] = True
        d["attention_dropout"] = 0.0
        d["initializer_range"] = 0.02
        d["pretraining_tp"] = 1
        d["aux_loss_alpha"] = 0.001
        d["seq_aux"] = True
        d["auto_map"] = {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        }
        wrapper = LAYOUTS[self.layout]
        if wrapper is None:
            return d
        # K2.5: the text model nested; the quantization_config (whose names carry the prefix) at the top
        model_type, architecture, _ = wrapper
        d.pop("architectures")
        d.pop("auto_map")
        top = {"architectures": [architecture], "model_type": model_type, "text_config": d}
        if "quantization_config" in d:
            top["quantization_config"] = d.pop("quantization_config")
        return top

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "K2Config":
        return _parse(raw, source)

    @classmethod
    def from_json(cls, path: str | Path) -> "K2Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = read_json_object(path, "a model directory needs a config.json", ConfigError)
        return _parse(raw, str(path))

    def write_json(self, path: str | Path) -> None:
        from k2trt.atomic import atomic_write_text

        atomic_write_text(Path(path), json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def preset(cls, name: str) -> "K2Config":
        try:
            return PRESETS[name]()
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn_get_mscale of modeling_deepseek.py."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# Fields a config.json must have; everything else falls back to the K2 default above.
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok",
)


def _unwrap(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], str, Any]:
    """(the text model's config, layout, quantization_config) of a config.json of either layout."""
    if "text_config" not in raw:
        return raw, "k2", raw.get("quantization_config")
    layout = next((k for k, w in LAYOUTS.items() if w and w[0] == raw.get("model_type")), None)
    if layout is None:
        raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} with a text_config is not a layout k2trt "
                          f"reads (expected {', '.join(w[0] for w in LAYOUTS.values() if w)})")
    text = raw["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config must be an object")
    top, inner = raw.get("quantization_config"), text.get("quantization_config")
    if top is not None and inner is not None and top != inner:
        raise ConfigError(f"{source}: quantization_config and text_config.quantization_config disagree; "
                          f"k2trt reads one")
    return text, layout, top if top is not None else inner


def _parse(raw: dict[str, Any], source: str) -> K2Config:
    raw, layout, q = _unwrap(raw, source)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported (expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: missing required field(s): {', '.join(missing)}")

    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        raise ConfigError(f"{source}: q_lora_rank null (no q LoRA) is not supported; K2 uses q_lora_rank 1536")

    names = {f.name: f for f in dataclasses.fields(K2Config)}
    kwargs: dict[str, Any] = {}
    for key, f in names.items():
        if key in ("rope_scaling", "layout", "quantization") or key not in raw:
            continue
        kwargs[key] = raw[key]

    rs = raw.get("rope_scaling", "absent")
    if rs is None:
        kwargs["rope_scaling"] = None
    elif rs != "absent":
        kwargs["rope_scaling"] = _parse_rope_scaling(rs, source)

    try:
        kwargs["quantization"] = parse_quantization(q, source)
    except QuantizationError as e:
        raise ConfigError(str(e)) from None
    kwargs["layout"] = layout

    # Types: ints stay ints, floats become floats, so a hand-edited "50000" is caught below.
    for key, value in list(kwargs.items()):
        if key in ("layout", "quantization"):
            continue
        default = names[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
        elif isinstance(default, int) and not isinstance(default, bool):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        elif isinstance(default, float):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
            kwargs[key] = float(value)
        elif isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
    cfg = K2Config(**kwargs)
    _validate(cfg, source)
    return cfg


# modeling_deepseek.py's DeepseekV3YarnRotaryEmbedding defaults, for keys a rope_scaling object leaves out
# (the attention's softmax scale also reads mscale_all_dim with default 0).
YARN_DEFAULTS = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                 "mscale_all_dim": 0.0}


def _parse_rope_scaling(rs, source: str) -> RopeScaling:
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object or null")
    rtype = rs.get("type", rs.get("rope_type", "yarn"))
    if rtype != "yarn":
        raise ConfigError(f"{source}: rope_scaling type {rtype!r} is not supported (only yarn)")
    if "factor" not in rs:
        raise ConfigError(f"{source}: rope_scaling needs a factor")
    values = {"factor": rs["factor"], **{k: rs.get(k, d) for k, d in YARN_DEFAULTS.items()}}
    for key, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"{source}: rope_scaling.{key} must be a number, got {v!r}")
    omax = values["original_max_position_embeddings"]
    if not float(omax).is_integer() or not 1 <= omax <= LIMITS["max_position_embeddings"]:
        raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings must be an integer in "
                          f"1..{LIMITS['max_position_embeddings']}, got {omax!r}")
    values["original_max_position_embeddings"] = int(omax)
    # YaRN takes logs of the factor and of the betas (modeling_deepseek.py yarn_find_correction_dim) and
    # divides by the mscale of mscale_all_dim: each must be a finite number in its range.
    for key, low, strict in (("factor", 0.0, True), ("beta_fast", 0.0, True), ("beta_slow", 0.0, True),
                             ("mscale", 0.0, False), ("mscale_all_dim", 0.0, False)):
        _check_number(f"rope_scaling.{key}", values[key], low, strict, source)
    return RopeScaling(type="yarn", **{k: (v if k == "original_max_position_embeddings" else float(v))
                                       for k, v in values.items()})


def _check_number(key: str, value: float, low: float, strict: bool, source: str, high: float | None = None) -> None:
    """A finite number above `low` (strictly, or at least it) and, when given, below `high`."""
    above = value > low if strict else value >= low
    if not math.isfinite(value) or not above or (high is not None and not value < high):
        where = f"{'>' if strict else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")
        raise ConfigError(f"{source}: {key} must be a finite number {where}, got {value!r}")


# Upper bounds on sizes: far above K2's (in brackets), low enough that no config makes inspect or export walk
# millions of tensors or allocate without bound.
LIMITS = {
    "vocab_size": 1 << 22,  # [163,840]
    "hidden_size": 1 << 17, "intermediate_size": 1 << 18, "moe_intermediate_size": 1 << 17,  # [7168, 18432, 2048]
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16,  # [1536, 512]
    "qk_nope_head_dim": 4096, "qk_rope_head_dim": 4096, "v_head_dim": 4096,  # [128, 64, 128]
    "num_attention_heads": 1024, "num_key_value_heads": 1024,  # [64]
    "num_hidden_layers": 1024, "first_k_dense_replace": 1024, "moe_layer_freq": 1024,  # [61, 1, 1]
    "n_routed_experts": 8192, "num_experts_per_tok": 8192, "n_shared_experts": 64,  # [384, 8, 1]
    "n_group": 8192, "topk_group": 8192,  # [1, 1]
    "max_position_embeddings": 1 << 24,  # [131,072]
    "num_nextn_predict_layers": 16,  # [0]
}
MAX_TENSORS = 1 << 21  # [139,583]: inspect and validation visit every tensor the config names


def tensor_count(cfg: K2Config) -> int:
    """Tensors the config names at most (graphs/weights.checkpoint_specs; a test keeps the two in step): the three
    globals, per dense layer 2 norms, 2 norm weights of attention and its 5 linears, the MLP's 3; per MoE layer the
    same plus the router's 2 and 3 linears per expert and 3 for the shared expert. A linear is 2 tensors in FP8
    (weight, scales), 1 in bf16, and at most 3 under compressed-tensors (packed, scales, shape): exact for FP8 and
    bf16 checkpoints, an upper bound for INT4 ones (whose bf16 linears store one)."""
    per_linear = {"fp8": 2, None: 1}.get(cfg.quantization.method, 3)
    moe = cfg.num_moe_layers
    dense_layer = 4 + 8 * per_linear
    moe_layer = 6 + (5 + 3 + 3 * cfg.n_routed_experts) * per_linear
    return 3 + dense_layer * (cfg.num_hidden_layers - moe) + moe_layer * moe


def _validate(cfg: K2Config, source: str) -> None:
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                "max_position_embeddings"):
        if getattr(cfg, key) <= 0:
            raise bad(f"{key} must be positive, got {getattr(cfg, key)}")
    for key, limit in LIMITS.items():
        if getattr(cfg, key) > limit:
            raise bad(f"{key} {getattr(cfg, key):,} is beyond what k2trt accepts ({limit:,})")
    if cfg.n_shared_experts < 0 or cfg.num_nextn_predict_layers < 0:
        raise bad("n_shared_experts and num_nextn_predict_layers must be >= 0")
    # The model divides by sqrt(mean(x^2) + eps), rotates by rope_theta^(-2i/d) (and YaRN takes log(rope_theta)),
    # and scales the routed experts' sum: NaN, infinity, zero or a negative value makes it compute garbage.
    _check_number("rms_norm_eps", cfg.rms_norm_eps, 0.0, True, source, high=1.0)
    _check_number("rope_theta", cfg.rope_theta, 1.0, True, source)
    _check_number("routed_scaling_factor", cfg.routed_scaling_factor, 0.0, True, source)
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise bad(f"num_key_value_heads ({cfg.num_key_value_heads}) must equal num_attention_heads "
                  f"({cfg.num_attention_heads}) for MLA")
    if cfg.qk_rope_head_dim % 2:
        raise bad(f"qk_rope_head_dim must be even, got {cfg.qk_rope_head_dim}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise bad(f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    if cfg.n_routed_experts % cfg.n_group:
        raise bad(f"n_routed_experts ({cfg.n_routed_experts}) is not divisible by n_group ({cfg.n_group})")
    if cfg.topk_group > cfg.n_group:
        raise bad(f"topk_group ({cfg.topk_group}) exceeds n_group ({cfg.n_group})")
    if cfg.topk_group * (cfg.n_routed_experts // cfg.n_group) < cfg.num_experts_per_tok:
        raise bad(f"topk_group ({cfg.topk_group}) groups of {cfg.n_routed_experts // cfg.n_group} experts hold fewer "
                  f"than num_experts_per_tok ({cfg.num_experts_per_tok})")
    if cfg.topk_method != "noaux_tc":
        raise bad(f"topk_method {cfg.topk_method!r} is not supported (only noaux_tc)")
    if cfg.scoring_func != "sigmoid":
        raise bad(f"scoring_func {cfg.scoring_func!r} is not supported (only sigmoid)")
    if cfg.moe_layer_freq <= 0 or cfg.first_k_dense_replace < 0:
        raise bad("moe_layer_freq must be positive and first_k_dense_replace non-negative")
    if cfg.tie_word_embeddings:
        raise bad("tie_word_embeddings true is not supported (K2's lm_head is untied)")
    if cfg.attention_bias:
        raise bad("attention_bias true is not supported")
    if not 0 <= cfg.bos_token_id < cfg.vocab_size or not 0 <= cfg.eos_token_id < cfg.vocab_size:
        raise bad(f"bos/eos token ids ({cfg.bos_token_id}/{cfg.eos_token_id}) must lie in the vocabulary "
                  f"(vocab_size {cfg.vocab_size})")
    # The W8A8 path quantizes activations in 1x128 groups: every input dimension of an FP8 linear
    # must be a whole number of groups. (INT4 group sizes are checked against the shapes in graphs/weights.py.)
    fp8 = cfg.quantization.method == "fp8"
    for name, k in (("hidden_size", cfg.hidden_size), ("q_lora_rank", cfg.q_lora_rank),
                    ("kv_lora_rank", cfg.kv_lora_rank),
                    ("num_attention_heads*v_head_dim", cfg.num_attention_heads * cfg.v_head_dim),
                    ("intermediate_size", cfg.intermediate_size),
                    ("moe_intermediate_size", cfg.moe_intermediate_size)):
        block = cfg.quantization.weight_block_size[1]
        if fp8 and k % block:
            raise bad(f"{name} ({k}) must be a multiple of {block} (FP8 activation groups)")
    if tensor_count(cfg) > MAX_TENSORS:
        raise bad(f"{tensor_count(cfg):,} tensors ({cfg.num_hidden_layers} layers x {cfg.n_routed_experts} experts) "
                  f"is beyond what k2trt accepts ({MAX_TENSORS:,}; K2 has 139,583)")


def kimi_k2() -> K2Config:
    """Exactly Kimi-K2-Instruct's config.json."""
    return K2Config()


# Kimi-K2-Thinking's quantization_config as its config.json publishes it: the routed experts INT4 (compressed-tensors
# pack-quantized, symmetric, group 32, QAT), attention, the shared experts, the dense MLP and lm_head left bf16
# (`targets: Linear` never reaches the router, the norms or the embedding: they are no Linear).
KIMI_K2_THINKING_QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
# K2.5 and K2.6 ignore by regular expression, the vision tower and its projector too (their names carry prefixes)
KIMI_K25_QUANTIZATION = {**KIMI_K2_THINKING_QUANTIZATION, "ignore": [
    "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
    "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def kimi_k2_thinking() -> K2Config:
    """Kimi-K2-Thinking: K2's text model at 256k context, its routed experts INT4."""
    return dataclasses.replace(K2Config(), max_position_embeddings=262144, rope_scaling=RopeScaling(factor=64.0),
                               quantization=parse_quantization(KIMI_K2_THINKING_QUANTIZATION, "kimi-k2-thinking"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_expert_parallel(cfg: K2Config, expert_parallel: int) -> None:
    """One line for an expert-parallel size that does not divide the routed experts (DeepseekV3MoE gives every
    rank n_routed_experts // ep_size of them), naming the nearest that do."""
    e = expert_parallel
    if e < 1:
        raise ConfigError(f"--expert-parallel must be >= 1, got {e}")
    if cfg.n_routed_experts % e:
        near = divisors(cfg.n_routed_experts)
        below = max(d for d in near if d < e)
        above = min((d for d in near if d > e), default=None)
        choice = f"{below}" + (f" or {above}" if above else "")
        raise ConfigError(f"--expert-parallel {e} does not divide the {cfg.n_routed_experts} routed experts "
                          f"(nearest that do: {choice})")


def expert_range(cfg: K2Config, expert_parallel: int, expert_rank: int) -> tuple[int, int]:
    """The routed experts [first, stop) expert-parallel rank `expert_rank` of `expert_parallel` holds: contiguous,
    n_routed_experts // ep_size each, as modeling_deepseek.py's DeepseekV3MoE assigns them (expert i lives on rank
    i // experts_per_rank). The one definition the planner, the weights a rank reads, the exported experts graph
    and the dispatch share."""
    check_expert_parallel(cfg, expert_parallel)
    n = cfg.n_routed_experts // expert_parallel
    return expert_rank * n, (expert_rank + 1) * n


def tiny() -> K2Config:
    """The embedded default: every structural feature of K2 at laptop size (~60 MB in FP8)."""
    return K2Config(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        # 384 experts, top-8, one shared, one group, sigmoid + bias, 2.827 — as K2.
        bos_token_id=1792,
        eos_token_id=1793,
    )


def tiny_int4() -> K2Config:
    """The embedded tiny in K2-Thinking's form: the same model, its routed experts INT4 (group 32)."""
    return dataclasses.replace(tiny(), quantization=parse_quantization(KIMI_K2_THINKING_QUANTIZATION, "tiny-int4"))


def tiny_k25() -> K2Config:
    """The tiny INT4 model in K2.5's layout: nested in text_config, tensors under language_model."""
    return dataclasses.replace(tiny(), layout="k2.5",
                               quantization=parse_quantization(KIMI_K25_QUANTIZATION, "tiny-k2.5"))


PRESETS = {"kimi-k2": kimi_k2, "kimi-k2-thinking": kimi_k2_thinking, "tiny": tiny, "tiny-int4": tiny_int4,
           "tiny-k2.5": tiny_k25}
