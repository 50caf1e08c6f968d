"""Seeded synthetic weights with K2's names, shapes and dtypes (graphs/weights.py), for the embedded tiny
checkpoint and for tests that want fresh random weights without a checkpoint on disk."""

from __future__ import annotations

import torch

from k2trt.config import K2Config
from k2trt.graphs import weights as W
from k2trt.graphs.fp8 import quantize_weight

# std of each tensor family. Linears are 1/sqrt(fan_in) times the factor; the projections that write into
# the residual stream are smaller so it stays tame over the layers.
INIT = {
    "linear": 1.0,
    "residual_out": 0.5,  # o_proj, down_proj
    "norm_noise": 0.05,
    "embedding": 1.0,
    "lm_head": 1.0,  # times 1/sqrt(hidden)
    "router": 1.0,  # times 1/sqrt(hidden)
    "bias": 0.02,
}

TORCH = {W.BF16: torch.bfloat16, W.F32: torch.float32}


def _normal(shape, std, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def init_tensors(cfg: K2Config, specs: list[W.TensorSpec], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors for a list of checkpoint specs (an FP8 weight yields its weight_scale_inv too)."""
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.is_scale:
            continue  # made with its weight
        name = s.name
        if s.dtype == W.FP8:
            fan_in = s.shape[-1]
            factor = INIT["residual_out"] if ("o_proj" in name or "down_proj" in name) else INIT["linear"]
            q, scale = quantize_weight(_normal(s.shape, factor / fan_in**0.5, gen))
            out[name] = q
            out[name + "_scale_inv"] = scale
        elif "norm" in name:
            out[name] = (1.0 + _normal(s.shape, INIT["norm_noise"], gen)).to(TORCH[s.dtype])
        elif name.endswith("e_score_correction_bias"):
            out[name] = _normal(s.shape, INIT["bias"], gen).to(TORCH[s.dtype])
        elif name == "model.embed_tokens.weight":
            out[name] = _normal(s.shape, INIT["embedding"], gen).to(TORCH[s.dtype])
        elif name == "lm_head.weight":
            out[name] = _normal(s.shape, INIT["lm_head"] / cfg.hidden_size**0.5, gen).to(TORCH[s.dtype])
        elif name == "mlp.gate.weight":
            out[name] = _normal(s.shape, INIT["router"] / cfg.hidden_size**0.5, gen).to(TORCH[s.dtype])
        else:
            raise ValueError(f"no initializer for {name}")
    return out


class RandomWeights:
    """A weight source like Checkpoint (.config, .block_weights(layer), .globals()) made from a seed."""

    def __init__(self, cfg: K2Config, seed: int = 0):
        self.config = cfg
        self.seed = seed

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + salt)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        return init_tensors(self.config, W.layer_specs(self.config, layer), self._gen(layer + 1))

    def globals(self) -> dict[str, torch.Tensor]:
        return init_tensors(self.config, W.global_specs(self.config), self._gen(0))

    def block_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return block_inputs_from_layer(self.config, layer, self.layer(layer))


def block_inputs_from_layer(cfg: K2Config, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one layer (suffix names) -> the block graph's weight inputs, in spec order, with
    the per-expert tensors stacked along a new leading expert axis."""
    out = {}
    for spec in W.block_weight_specs(cfg, cfg.layer_kind(layer)):
        if spec.name.startswith("mlp.experts."):
            out[spec.name] = torch.stack([tensors[n] for n in W.stacked_source_names(spec.name, cfg.n_routed_experts)])
        else:
            out[spec.name] = tensors[spec.name]
    return out
