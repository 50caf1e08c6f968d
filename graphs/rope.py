"""YaRN rotary embedding of modeling_deepseek.py (DeepseekV3YarnRotaryEmbedding) and the per-step tables.

The runtime computes the tables once per step from each sequence's positions and every block shares them:
rope_cos / rope_sin [B, T, rope/2] (one angle per pair; the HF code duplicates them as cat(freqs, freqs)).
"""

from __future__ import annotations

import functools
import math

import torch

from k2trt.config import K2Config, yarn_mscale


def _find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_correction_range(cfg: K2Config) -> tuple[int, int]:
    rs = cfg.rope_scaling
    dim = cfg.qk_rope_head_dim
    low = math.floor(_find_correction_dim(rs.beta_fast, dim, cfg.rope_theta, rs.original_max_position_embeddings))
    high = math.ceil(_find_correction_dim(rs.beta_slow, dim, cfg.rope_theta, rs.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def inv_freq(cfg: K2Config) -> torch.Tensor:
    """[rope/2] float32 inverse frequencies, YaRN-blended when rope_scaling is set."""
    return _inv_freq(cfg).clone()  # a copy of the cached table: callers may modify it


@functools.lru_cache(maxsize=8)  # every step of every generation asks
def _inv_freq(cfg: K2Config) -> torch.Tensor:
    dim = cfg.qk_rope_head_dim
    extra = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return extra
    inter = extra / rs.factor
    low, high = yarn_correction_range(cfg)
    if low == high:
        high += 0.001  # avoid a division by zero, as the reference does
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 keeps the base ("extrapolated") frequency, ramp 1 the interpolated one
    return inter * ramp + extra * (1 - ramp)


def attention_mscale(cfg: K2Config) -> float:
    """The factor on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim) (= 1 for K2)."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)


def rope_tables(cfg: K2Config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] (int) -> cos, sin [B, T, rope/2] float32."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq(cfg)
    m = attention_mscale(cfg)
    return freqs.cos() * m, freqs.sin() * m
