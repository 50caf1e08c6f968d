"""The interface every backend implements — ONNX Runtime, TensorRT and the torch reference — so one runtime
(runtime/generator.py) chains embedding -> blocks -> head for all of them.

All tensors are torch tensors on the backend's device; `latent_cache` is a view of the runtime's
preallocated per-layer cache [B, capacity, kv_lora + rope], passed in place (never copied), and the runtime
writes the returned `latent_new` into it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Backend(Protocol):
    name: str
    device: torch.device
    act_dtype: torch.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] int64 -> hidden [B, T, d]."""

    def block(self, layer: int, hidden: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
              mask: torch.Tensor, latent_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, d], rope_cos/sin [B, T, rope/2], mask [B, T, P + T] float32,
        latent_cache [B, P, latent] -> (hidden [B, T, d], latent_new [B, T, latent])."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, d] -> logits [B, T, V] float32."""
