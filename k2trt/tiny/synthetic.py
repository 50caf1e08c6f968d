"""Seeded synthetic weights with K2's names, shapes and dtypes (graphs/weights.py): the embedded tiny
checkpoint is made from them, and tests use them for fresh random weights without a checkpoint on disk.
Each layer has its own generator, so any layer can be made alone and equals the checkpoint's.

The tiny model's tokenizer fixes which vocabulary rows are special tokens: their lm_head rows are small, as the
rows of tokens never seen in training are in a real model."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from k2trt.config import K2Config

from k2trt.graphs import int4
from k2trt.graphs import weights as W
from k2trt.graphs.fp8 import quantize_weight
from k2trt.quantization import FP8_BLOCK, INT4_GROUP
from k2trt.runtime.text.tokenizer import NUM_RESERVED_SPECIAL
from k2trt.tiny.tokenizer import SPECIAL_OFFSETS

# Initialization scales, in one place to tune. Linear weights are normal with std = factor / sqrt(in_features);
# the two linears that write into the residual stream (o_proj, down_proj) are smaller so it stays tame.
INIT = {
    "linear": 1.0,            # x 1/sqrt(in_features)
    "residual_linear": 0.5,   # o_proj, down_proj: x 1/sqrt(in_features)
    "norm_noise": 0.05,       # RMSNorm weights: 1 + N(0, this)
    "embed": 1.0,             # embed_tokens std
    "lm_head": 1.0,           # x 1/sqrt(hidden_size)
    "router": 1.0,            # mlp.gate.weight: x 1/sqrt(hidden_size)
    "bias": 0.02,             # e_score_correction_bias std
    "special_lm_head": 0.1,   # lm_head rows of the 256 special ids, except [EOS] and <|im_end|>: as in a trained
                              # model, reserved tokens (never seen in training) almost never win
}

# [EOS] and <|im_end|>: the specials generation stops on, which keep full-size lm_head rows
STOP_OFFSETS = tuple(o for o, name in SPECIAL_OFFSETS.items() if name in ("[EOS]", "<|im_end|>"))


def _linear_std(name: str, in_features: int, init: dict[str, float]) -> float:
    residual = name.endswith(("o_proj.weight", "down_proj.weight"))
    return init["residual_linear" if residual else "linear"] / math.sqrt(in_features)


def _norm(shape: tuple[int, ...], g: torch.Generator, init: dict[str, float]) -> torch.Tensor:
    return (1.0 + torch.randn(shape, generator=g) * init["norm_noise"]).to(torch.bfloat16)


def stored_linear(w: torch.Tensor, prefix: str, fmt) -> dict[str, torch.Tensor]:
    """A float32 weight [.., N, K] as the checkpoint stores it in `fmt` (suffix -> tensor): FP8 with its block
    scales, INT4 packed by compressed-tensors' own pack_to_int32 with its group scales and weight_shape (int32, as
    Moonshot's files hold it), or bf16."""
    if fmt.kind == FP8_BLOCK:
        q, s = quantize_weight(w)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s}
    if fmt.kind == INT4_GROUP:
        q, s = int4.quantize_weight(w, fmt.group_size)
        shape = torch.tensor(w.shape[-2:], dtype=torch.int32).expand(*w.shape[:-2], 2)
        return {f"{prefix}.weight_packed": int4.pack(q), f"{prefix}.weight_scale": s,
                f"{prefix}.weight_shape": shape.contiguous()}
    return {f"{prefix}.weight": w.to(torch.bfloat16)}


def layer_tensors(cfg: K2Config, layer: int, g: torch.Generator, init: dict[str, float] = INIT
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's checkpoint tensors (suffix names) in layer_specs order."""
    made: dict[str, torch.Tensor] = {}
    kind = cfg.layer_kind(layer)
    if kind == "moe_block":
        # All experts of one projection at once: one batched quantize instead of E small ones.
        fmt = W.experts_format(cfg)
        for proj in W.EXPERT_PROJS:
            n, k = W.linear_shapes(cfg, kind)[f"mlp.experts.{proj}"]
            w = torch.randn(cfg.n_routed_experts, n, k, generator=g) * _linear_std(f"{proj}.weight", k, init)
            for suffix, t in stored_linear(w, proj, fmt).items():
                for e in range(cfg.n_routed_experts):
                    made[f"mlp.experts.{e}.{suffix}"] = t[e].clone()  # clone: no shared storage in a file
    roles = W.linear_shapes(cfg, kind)
    for spec in W.layer_specs(cfg, layer):
        role = spec.name.rsplit(".", 1)[0]
        if spec.name in made:
            yield spec.name, made.pop(spec.name)
        elif role in roles:  # the first tensor of a linear: make all of them; the rest follow from `made`
            n, k = roles[role]
            w = torch.randn(n, k, generator=g) * _linear_std(f"{role}.weight", k, init)
            made.update(stored_linear(w, role, W.role_format(cfg, kind, role)))
            yield spec.name, made.pop(spec.name)
        elif spec.name.endswith("layernorm.weight"):
            yield spec.name, _norm(spec.shape, g, init)
        elif spec.name == "mlp.gate.weight":
            std = init["router"] / math.sqrt(cfg.hidden_size)
            yield spec.name, (torch.randn(spec.shape, generator=g) * std).to(torch.bfloat16)
        elif spec.name == "mlp.gate.e_score_correction_bias":
            yield spec.name, torch.randn(spec.shape, generator=g) * init["bias"]
        else:
            raise AssertionError(f"no initializer for {spec.name}")


def global_tensors(cfg: K2Config, g: torch.Generator, init: dict[str, float] = INIT) -> dict[str, torch.Tensor]:
    embed, norm, head = W.global_specs(cfg)
    lm_head = torch.randn(head.shape, generator=g) * (init["lm_head"] / math.sqrt(cfg.hidden_size))
    first_special = cfg.vocab_size - NUM_RESERVED_SPECIAL
    if first_special > 0:
        scale = torch.ones(cfg.vocab_size)
        scale[first_special:] = init["special_lm_head"]
        scale[[first_special + o for o in STOP_OFFSETS]] = 1.0
        lm_head = lm_head * scale[:, None]
    return {
        embed.name: (torch.randn(embed.shape, generator=g) * init["embed"]).to(torch.bfloat16),
        norm.name: _norm(norm.shape, g, init),
        head.name: lm_head.to(torch.bfloat16),
    }


class RandomWeights:
    """A weight source like Checkpoint (.config, .layer(i), .block_weights(i), .globals()) made from a seed."""

    def __init__(self, cfg: K2Config, seed: int = 0):
        self.config = cfg
        self.seed = seed

    def _gen(self, salt: int) -> torch.Generator:
        # one stream per (seed, salt), reduced to the 64 bits manual_seed takes (small seeds are unchanged)
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt) % 2**64)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return dict(layer_tensors(self.config, layer, self._gen(layer + 1)))

    def globals(self, names=None) -> dict[str, torch.Tensor]:
        made = global_tensors(self.config, self._gen(0))
        return made if names is None else {n: made[n] for n in names}

    def block_weights(self, layer: int, experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        tensors = self.layer(layer)
        return W.assemble_block_weights(self.config, layer,
                                       lambda name, out: tensors[name] if out is None else out.copy_(tensors[name]),
                                       experts)


def synthetic_tensors(cfg: K2Config, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights with full names in checkpoint_writer.ordered_specs order (one layer made
    at a time)."""
    weights = RandomWeights(cfg, seed)
    g = weights.globals()
    embed, norm, head = W.global_specs(cfg)
    yield embed.name, g[embed.name]
    for layer in range(cfg.num_hidden_layers):
        p = W.layer_prefix(layer)
        for name, tensor in weights.layer(layer).items():
            yield p + name, tensor
    yield norm.name, g[norm.name]
    yield head.name, g[head.name]


def synthetic_prompts(cfg: K2Config, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts of ordinary (not special) token ids, for the benchmarks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size - NUM_RESERVED_SPECIAL, (batch, length), generator=g).tolist()
