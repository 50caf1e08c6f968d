"""Names, shapes and dtypes of every weight, derived from the config: one table for the checkpoint
writer, the reader's validation, the parameter accounting and the graph inputs.

Per-layer names are suffixes after `model.layers.N.`; globals are full names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import torch

from k2trt.config import MOE_PART_KINDS, ConfigError, K2Config
from k2trt.dtypes import BF16, F32, FP8, torch_dtype
from k2trt.graphs.fp8 import BLOCK, cdiv
from k2trt.quantization import BF16 as BF16_FORMAT
from k2trt.quantization import FP8_BLOCK, INT4_GROUP, LINEAR, PACK_FACTOR, WeightFormat

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
I32 = "int32"

# TensorSpec.kind: what a tensor holds
PARAM = "weight"  # parameters of the model (an FP8 or bf16 weight, an INT4 packed weight, a norm, the router bias)
SCALE = "scale"  # FP8 block scales (weight_scale_inv) or INT4 group scales (weight_scale)
SHAPE = "shape"  # an INT4 weight's logical shape (weight_shape): checked, never a graph input


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = PARAM
    pack: int = 1  # model parameters per stored element: 8 for INT4 values packed in int32
    also: tuple[str, ...] = ()  # other dtypes a checkpoint may store it in (weight_shape: int64 as the library writes)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def params(self) -> int:
        """Logical parameters: packing changes storage, not the model; scales and shapes are not parameters."""
        return self.numel * self.pack if self.kind == PARAM else 0

    @property
    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize

    @property
    def is_scale(self) -> bool:
        return self.kind == SCALE

    def accepts(self, dtype: str) -> bool:
        return dtype == self.dtype or dtype in self.also

    def renamed(self, name: str) -> "TensorSpec":
        # the fields by position, not dataclasses.replace: K2's 400k specs are renamed per table built (seconds)
        return TensorSpec(name, self.shape, self.dtype, self.kind, self.pack, self.also)


def linear_specs(prefix: str, out_features: int, in_features: int, fmt: WeightFormat) -> list[TensorSpec]:
    """One Linear as the checkpoint stores it in its format:
      FP8: the e4m3 weight and its float32 128x128 block scales (partial edge blocks count);
      INT4 (compressed-tensors pack-quantized): weight_packed int32 [out, in/8], weight_scale bf16 [out, in/g] and
        weight_shape [2] = (out, in);
      bf16: the weight."""
    if fmt.kind == FP8_BLOCK:
        return [
            TensorSpec(f"{prefix}.weight", (out_features, in_features), FP8),
            TensorSpec(f"{prefix}.weight_scale_inv", (cdiv(out_features, BLOCK), cdiv(in_features, BLOCK)), F32,
                       SCALE),
        ]
    if fmt.kind == INT4_GROUP:
        return [
            TensorSpec(f"{prefix}.weight_packed", (out_features, cdiv(in_features, PACK_FACTOR)), I32,
                       pack=PACK_FACTOR),
            TensorSpec(f"{prefix}.weight_scale", (out_features, in_features // fmt.group_size), BF16, SCALE),
            TensorSpec(f"{prefix}.weight_shape", (2,), I32, SHAPE, also=("int64",)),
        ]
    return [TensorSpec(f"{prefix}.weight", (out_features, in_features), BF16)]


# ---- which format each linear is stored in --------------------------------------------------------------------
# A role is a linear of a block kind, named by its suffix with the expert index removed; one graph serves every
# layer of a kind, so every layer (and every expert) must store a role in one format.

def linear_shapes(cfg: K2Config, kind: str) -> dict[str, tuple[int, int]]:
    """role -> (out_features, in_features) of every linear of a block kind, in checkpoint order."""
    h, d = cfg.num_attention_heads, cfg.hidden_size
    shapes = {
        "self_attn.q_a_proj": (cfg.q_lora_rank, d),
        "self_attn.q_b_proj": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa": (cfg.latent_dim, d),
        "self_attn.kv_b_proj": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj": (d, h * cfg.v_head_dim),
    }

    def swiglu(prefix: str, inter: int) -> dict:
        return {f"{prefix}.gate_proj": (inter, d), f"{prefix}.up_proj": (inter, d), f"{prefix}.down_proj": (d, inter)}

    if kind == "dense_block":
        return {**shapes, **swiglu("mlp", cfg.intermediate_size)}
    if kind == "moe_block":
        return {**shapes, **swiglu("mlp.experts", cfg.moe_intermediate_size),
                **swiglu("mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)}
    raise ValueError(f"unknown block kind {kind!r}")


def _instances(cfg: K2Config, role: str, layers: list[int]) -> list[str]:
    """The module names (logical, without the layout prefix) a role stands for."""
    if role.startswith("mlp.experts."):
        proj = role[len("mlp.experts."):]
        return [f"{layer_prefix(i)}mlp.experts.{e}.{proj}" for i in layers for e in range(cfg.n_routed_experts)]
    return [f"{layer_prefix(i)}{role}" for i in layers]


# modules that are no Linear in the reference code (modeling_deepseek.py), read as bf16 whatever a config says
_OTHER_MODULES = (("input_layernorm", "DeepseekV3RMSNorm"), ("post_attention_layernorm", "DeepseekV3RMSNorm"),
                  ("self_attn.q_a_layernorm", "DeepseekV3RMSNorm"), ("self_attn.kv_a_layernorm", "DeepseekV3RMSNorm"))


@lru_cache(maxsize=8)
def weight_formats(cfg: K2Config) -> dict[tuple[str, str], WeightFormat]:
    """(block kind, role) -> the format every layer of that kind stores the role in, plus ("head", "lm_head"):
    decided from quantization_config for every module the model uses. A config k2trt cannot run — a role stored
    in two formats across layers or experts, INT4 outside the routed experts, bf16 routed experts, a quantized
    norm, router, embedding or lm_head, a group size that does not divide a linear's input — is one ConfigError."""
    q, prefix = cfg.quantization, cfg.weight_prefix
    out: dict[tuple[str, str], WeightFormat] = {}
    by_kind: dict[str, list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        by_kind.setdefault(cfg.layer_kind(i), []).append(i)
    for kind in ("dense_block", "moe_block"):
        layers = by_kind.get(kind, [])
        for role, (_, in_features) in linear_shapes(cfg, kind).items():
            first, first_name = None, None
            for name in _instances(cfg, role, layers or [0]):  # a kind no layer has: what layer 0 would store
                fmt = q.module_format(prefix + name, LINEAR)
                if first is None:
                    first, first_name = fmt, name
                elif not fmt.same(first):
                    raise ConfigError(f"quantization_config stores {prefix}{first_name} as {first.describe()} "
                                      f"({first.source}) but {prefix}{name} as {fmt.describe()} ({fmt.source}): "
                                      f"k2trt needs every layer of a kind to store a projection in one format")
            if layers:  # a kind no layer has stores nothing to refuse (an EAGLE-3 draft's one dense layer)
                _check_role(cfg, kind, role, in_features, first, prefix + first_name)
            out[(kind, role)] = first
        for suffix, cls in _OTHER_MODULES + ((("mlp.gate", "MoEGate"),) if kind == "moe_block" else ()):
            for i in layers:
                _check_bf16(q.module_format(f"{prefix}{layer_prefix(i)}{suffix}", cls), f"{prefix}{layer_prefix(i)}{suffix}")
    for name, cls in (("model.embed_tokens", "Embedding"), ("model.norm", "DeepseekV3RMSNorm"), ("lm_head", LINEAR)):
        _check_bf16(q.module_format(prefix + name, cls), prefix + name)
    out[("head", "lm_head")] = WeightFormat(BF16_FORMAT)
    return out


def _check_bf16(fmt: WeightFormat, name: str) -> None:
    if fmt.kind != BF16_FORMAT:
        raise ConfigError(f"{fmt.source} makes {name} {fmt.describe()}: k2trt reads it as bf16 (add it to "
                          f"quantization_config.ignore)")


def _check_role(cfg: K2Config, kind: str, role: str, in_features: int, fmt: WeightFormat, name: str) -> None:
    experts = role.startswith("mlp.experts.")
    if experts and fmt.kind == BF16_FORMAT:
        raise ConfigError(f"{name} is bf16 ({fmt.source}): k2trt runs routed experts as FP8 blocks or INT4 "
                          f"pack-quantized")
    if not experts and fmt.kind == INT4_GROUP:
        raise ConfigError(f"{fmt.source} makes {name} {fmt.describe()}: k2trt runs INT4 only in the routed experts "
                          f"(K2-Thinking's quantization_config.ignore keeps attention, the shared experts and the "
                          f"dense MLP in bf16)")
    if fmt.kind == INT4_GROUP and in_features % fmt.group_size:
        raise ConfigError(f"{fmt.source}.group_size {fmt.group_size} does not divide the {in_features} input "
                          f"channels of {name}")


def role_format(cfg: K2Config, kind: str, role: str) -> WeightFormat:
    return weight_formats(cfg)[(kind, role)]


def experts_format(cfg: K2Config) -> WeightFormat:
    """The routed experts' format (every MoE layer stores them in one: weight_formats)."""
    return role_format(cfg, "moe_block", "mlp.experts.gate_proj")


def _linears(cfg: K2Config, kind: str, prefix: str) -> list[TensorSpec]:
    """The specs of the linears of a kind whose role starts with `prefix` (expert linears under mlp.experts.0)."""
    out = []
    for role, (n, k) in linear_shapes(cfg, kind).items():
        if role.startswith(prefix):
            out += linear_specs(role, n, k, role_format(cfg, kind, role))
    return out


def attention_specs(cfg: K2Config, kind: str = "moe_block") -> list[TensorSpec]:
    specs = _linears(cfg, kind, "self_attn.")
    # the two norms of attention sit after the linear they follow, as the checkpoint orders them
    def after(role: str) -> int:
        return max(i for i, s in enumerate(specs) if s.name.startswith(role + ".")) + 1

    specs.insert(after("self_attn.q_a_proj"), TensorSpec("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), BF16))
    specs.insert(after("self_attn.kv_a_proj_with_mqa"),
                 TensorSpec("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), BF16))
    return specs


def norm_specs(cfg: K2Config) -> list[TensorSpec]:
    return [
        TensorSpec("input_layernorm.weight", (cfg.hidden_size,), BF16),
        TensorSpec("post_attention_layernorm.weight", (cfg.hidden_size,), BF16),
    ]


def dense_mlp_specs(cfg: K2Config) -> list[TensorSpec]:
    return _linears(cfg, "dense_block", "mlp.")


def router_specs(cfg: K2Config) -> list[TensorSpec]:
    return [
        TensorSpec("mlp.gate.weight", (cfg.n_routed_experts, cfg.hidden_size), BF16),
        TensorSpec("mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), F32),
    ]


def shared_expert_specs(cfg: K2Config) -> list[TensorSpec]:
    return _linears(cfg, "moe_block", "mlp.shared_experts.")


def expert_specs(cfg: K2Config, expert: int, template: list[TensorSpec] | None = None) -> list[TensorSpec]:
    """One routed expert's tensors (`template`: _routed_template(cfg), made once for a layer's 384)."""
    return [s.renamed(s.name.replace("mlp.experts.", f"mlp.experts.{expert}.", 1))
            for s in template or _routed_template(cfg)]


def _routed_template(cfg: K2Config) -> list[TensorSpec]:
    return _linears(cfg, "moe_block", "mlp.experts.")


def layer_specs(cfg: K2Config, layer: int) -> list[TensorSpec]:
    """Every checkpoint tensor of one layer, as name suffixes after `model.layers.{layer}.`."""
    kind = cfg.layer_kind(layer)
    specs = norm_specs(cfg) + attention_specs(cfg, kind)
    if kind == "moe_block":
        specs += router_specs(cfg)
        template = _routed_template(cfg)
        for e in range(cfg.n_routed_experts):
            specs += expert_specs(cfg, e, template)
        specs += shared_expert_specs(cfg)
    else:
        specs += dense_mlp_specs(cfg)
    return specs


def global_specs(cfg: K2Config) -> list[TensorSpec]:
    return [
        TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), BF16),
        TensorSpec("model.norm.weight", (cfg.hidden_size,), BF16),
        TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), BF16),
    ]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def checkpoint_specs(cfg: K2Config) -> dict[str, TensorSpec]:
    """Full tensor name -> spec for the whole checkpoint (139,583 tensors for K2)."""
    out: dict[str, TensorSpec] = {}
    for s in global_specs(cfg):
        out[s.name] = s
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        for s in layer_specs(cfg, layer):
            out[p + s.name] = s.renamed(p + s.name)
    return out


# ---- graph-level weights ------------------------------------------------------------------------
# The MoE graph takes each expert projection of all experts stacked along a leading expert axis,
# named after the checkpoint suffix with the expert index removed: mlp.experts.gate_proj.weight [E, I, d].

def stacked_expert_specs(cfg: K2Config, experts: int | None = None) -> list[TensorSpec]:
    """Each routed-expert tensor stacked over the experts (an INT4 weight_shape is checked, not stacked): all of
    them, or `experts` of them (one expert-parallel rank's share)."""
    e = cfg.n_routed_experts if experts is None else experts
    return [replace(s, name=s.name.replace("mlp.experts.0.", "mlp.experts."), shape=(e, *s.shape))
            for s in expert_specs(cfg, 0) if s.kind != SHAPE]


def stacked_source_names(stacked_name: str, n_experts: int) -> list[str]:
    """The per-expert checkpoint suffixes that one stacked graph weight is made of."""
    rest = stacked_name[len("mlp.experts."):]
    return [f"mlp.experts.{e}.{rest}" for e in range(n_experts)]


def assemble_block_weights(cfg: K2Config, layer: int, read: Callable[[str, torch.Tensor | None], torch.Tensor],
                           experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The weight inputs of one layer's block graph, in spec order, each routed-expert projection stacked along
    a new leading expert axis. `read(suffix, out)` returns the checkpoint tensor `suffix` (the name after
    `model.layers.N.`): written into `out` when one is given (an expert's slice of its stack), else as the
    source has it. `experts` = (first, stop): only those routed experts are read and stacked (an expert-parallel
    rank's share, runtime/distributed/layout.expert_range). The one place experts are stacked, whether they come
    from a file or from memory."""
    first, stop = (0, cfg.n_routed_experts) if experts is None else experts
    out = {}
    for spec in block_weight_specs(cfg, cfg.layer_kind(layer), stop - first):
        if spec.name.startswith("mlp.experts."):
            out[spec.name] = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
            for e, src in enumerate(stacked_source_names(spec.name, cfg.n_routed_experts)[first:stop]):
                read(src, out[spec.name][e])
        else:
            out[spec.name] = read(spec.name, None)
    return out


def graph_dtype(dtype: str, act_dtype: str) -> str:
    """The element type a checkpoint tensor of `dtype` has as a graph input: 16-bit float tensors (norms,
    embeddings, router, lm_head) take the activation dtype; FP8 weights and float32 scales and bias keep theirs."""
    return act_dtype if dtype in (BF16, "float16") else dtype


def as_graph_input(t: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor in the dtype graph_dtype gives it (no copy where it already has it)."""
    return t.to(act) if t.dtype in (torch.bfloat16, torch.float16) else t


def block_weight_specs(cfg: K2Config, kind: str, experts: int | None = None) -> list[TensorSpec]:
    """The weight inputs of one block graph (dense_block or moe_block; `experts` of the routed experts stacked,
    default all): INT4 weight_shapes are not among them."""
    specs = norm_specs(cfg) + attention_specs(cfg, kind)
    if kind == "dense_block":
        specs += dense_mlp_specs(cfg)
    elif kind == "moe_block":
        specs += router_specs(cfg) + stacked_expert_specs(cfg, experts) + shared_expert_specs(cfg)
    else:
        raise ValueError(f"unknown block kind {kind!r}")
    return [s for s in specs if s.kind != SHAPE]


def moe_part_weight_specs(cfg: K2Config, kind: str, experts: int) -> list[TensorSpec]:
    """The weight inputs of a MoE block's parts under expert parallelism (config.MOE_PART_KINDS): the front holds
    all but the routed experts, the experts graph `experts` of them stacked, the combine none."""
    whole = block_weight_specs(cfg, "moe_block", experts)
    routed = [s for s in whole if s.name.startswith("mlp.experts.")]
    if kind == "moe_front":
        return [s for s in whole if s not in routed]
    if kind == "moe_experts":
        return routed
    if kind == "moe_combine":
        return []
    raise ValueError(f"unknown MoE part {kind!r}")


def embedding_weight_specs(cfg: K2Config) -> list[TensorSpec]:
    return [global_specs(cfg)[0]]


def head_weight_specs(cfg: K2Config) -> list[TensorSpec]:
    return global_specs(cfg)[1:]


def graph_weight_specs(cfg: K2Config, kind: str, experts: int | None = None) -> list[TensorSpec]:
    """The weight inputs of one graph kind; `experts`: the routed experts one expert-parallel rank holds (the
    moe_experts part)."""
    if kind == "embedding":
        return embedding_weight_specs(cfg)
    if kind == "head":
        return head_weight_specs(cfg)
    if kind in MOE_PART_KINDS:
        return moe_part_weight_specs(cfg, kind, cfg.n_routed_experts if experts is None else experts)
    return block_weight_specs(cfg, kind)


def parameter_count(specs) -> int:
    """Logical parameters of a list of specs: scales and INT4 shapes excluded (as the seed pages count), INT4 values
    counted unpacked."""
    return sum(s.params for s in specs)


def stored_bytes(specs) -> int:
    """Bytes the specs take on disk: weights, scales and shapes."""
    return sum(s.nbytes for s in specs)
