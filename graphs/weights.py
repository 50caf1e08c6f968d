"""Names, shapes and dtypes of every weight, derived from the config: one table for the checkpoint
writer, the reader's validation, the parameter accounting and the graph inputs.

Per-layer names are suffixes after `model.layers.N.`; globals are full names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k2trt.config import K2Config
from k2trt.dtypes import BF16, F32, FP8, torch_dtype
from k2trt.graphs.fp8 import BLOCK, cdiv

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_scale(self) -> bool:
        return self.name.endswith("weight_scale_inv")


def fp8_linear(prefix: str, out_features: int, in_features: int) -> list[TensorSpec]:
    """An FP8 Linear: the e4m3 weight and its float32 128x128 block scales (partial edge blocks count)."""
    return [
        TensorSpec(f"{prefix}.weight", (out_features, in_features), FP8),
        TensorSpec(f"{prefix}.weight_scale_inv", (cdiv(out_features, BLOCK), cdiv(in_features, BLOCK)), F32),
    ]


def attention_specs(cfg: K2Config) -> list[TensorSpec]:
    h = cfg.num_attention_heads
    return [
        *fp8_linear("self_attn.q_a_proj", cfg.q_lora_rank, cfg.hidden_size),
        TensorSpec("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), BF16),
        *fp8_linear("self_attn.q_b_proj", h * cfg.qk_head_dim, cfg.q_lora_rank),
        *fp8_linear("self_attn.kv_a_proj_with_mqa", cfg.latent_dim, cfg.hidden_size),
        TensorSpec("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,), BF16),
        *fp8_linear("self_attn.kv_b_proj", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        *fp8_linear("self_attn.o_proj", cfg.hidden_size, h * cfg.v_head_dim),
    ]


def norm_specs(cfg: K2Config) -> list[TensorSpec]:
    return [
        TensorSpec("input_layernorm.weight", (cfg.hidden_size,), BF16),
        TensorSpec("post_attention_layernorm.weight", (cfg.hidden_size,), BF16),
    ]


def swiglu_specs(prefix: str, d: int, inter: int) -> list[TensorSpec]:
    return [
        *fp8_linear(f"{prefix}.gate_proj", inter, d),
        *fp8_linear(f"{prefix}.up_proj", inter, d),
        *fp8_linear(f"{prefix}.down_proj", d, inter),
    ]


def router_specs(cfg: K2Config) -> list[TensorSpec]:
    return [
        TensorSpec("mlp.gate.weight", (cfg.n_routed_experts, cfg.hidden_size), BF16),
        TensorSpec("mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), F32),
    ]


def shared_expert_specs(cfg: K2Config) -> list[TensorSpec]:
    return swiglu_specs("mlp.shared_experts", cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)


def expert_specs(cfg: K2Config, expert: int) -> list[TensorSpec]:
    return swiglu_specs(f"mlp.experts.{expert}", cfg.hidden_size, cfg.moe_intermediate_size)


def layer_specs(cfg: K2Config, layer: int) -> list[TensorSpec]:
    """Every checkpoint tensor of one layer, as name suffixes after `model.layers.{layer}.`."""
    specs = norm_specs(cfg) + attention_specs(cfg)
    if cfg.is_moe_layer(layer):
        specs += router_specs(cfg)
        for e in range(cfg.n_routed_experts):
            specs += expert_specs(cfg, e)
        specs += shared_expert_specs(cfg)
    else:
        specs += swiglu_specs("mlp", cfg.hidden_size, cfg.intermediate_size)
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
            out[p + s.name] = TensorSpec(p + s.name, s.shape, s.dtype)
    return out


# ---- graph-level weights ------------------------------------------------------------------------
# The MoE graph takes each expert projection of all experts stacked along a leading expert axis,
# named after the checkpoint suffix with the expert index removed: mlp.experts.gate_proj.weight [E, I, d].

def stacked_expert_specs(cfg: K2Config) -> list[TensorSpec]:
    e = cfg.n_routed_experts
    return [TensorSpec(s.name.replace("mlp.experts.0.", "mlp.experts."), (e, *s.shape), s.dtype)
            for s in expert_specs(cfg, 0)]


def stacked_source_names(stacked_name: str, n_experts: int) -> list[str]:
    """The per-expert checkpoint suffixes that one stacked graph weight is made of."""
    rest = stacked_name[len("mlp.experts."):]
    return [f"mlp.experts.{e}.{rest}" for e in range(n_experts)]


def assemble_block_weights(cfg: K2Config, layer: int,
                           read: Callable[[str, torch.Tensor | None], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight inputs of one layer's block graph, in spec order, each routed-expert projection stacked along
    a new leading expert axis. `read(suffix, out)` returns the checkpoint tensor `suffix` (the name after
    `model.layers.N.`): written into `out` when one is given (an expert's slice of its stack), else as the
    source has it. The one place experts are stacked, whether they come from a file or from memory."""
    out = {}
    for spec in block_weight_specs(cfg, cfg.layer_kind(layer)):
        if spec.name.startswith("mlp.experts."):
            out[spec.name] = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
            for e, src in enumerate(stacked_source_names(spec.name, cfg.n_routed_experts)):
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


def block_weight_specs(cfg: K2Config, kind: str) -> list[TensorSpec]:
    """The weight inputs of one block graph (dense_block or moe_block)."""
    specs = norm_specs(cfg) + attention_specs(cfg)
    if kind == "dense_block":
        return specs + swiglu_specs("mlp", cfg.hidden_size, cfg.intermediate_size)
    if kind == "moe_block":
        return specs + router_specs(cfg) + stacked_expert_specs(cfg) + shared_expert_specs(cfg)
    raise ValueError(f"unknown block kind {kind!r}")


def embedding_weight_specs(cfg: K2Config) -> list[TensorSpec]:
    return [global_specs(cfg)[0]]


def head_weight_specs(cfg: K2Config) -> list[TensorSpec]:
    return global_specs(cfg)[1:]


def graph_weight_specs(cfg: K2Config, kind: str) -> list[TensorSpec]:
    if kind == "embedding":
        return embedding_weight_specs(cfg)
    if kind == "head":
        return head_weight_specs(cfg)
    return block_weight_specs(cfg, kind)


def parameter_count(specs) -> int:
    """Parameters of a list of specs, FP8 block scales excluded (as the seed pages count)."""
    return sum(s.numel for s in specs if not s.is_scale)
