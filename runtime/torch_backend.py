"""The torch reference as a backend: the same interface, so generation through it is the reference."""

from __future__ import annotations

import torch

from k2trt.graphs.fp8 import WEIGHT_DEQUANT
from k2trt.graphs.reference import ReferenceModel


class TorchBackend(ReferenceModel):
    name = "torch"
    device = torch.device("cpu")  # the reference computes on the CPU, in float32 by default

    def __init__(self, weights, act_dtype: str = "float32", activation_quant: int = WEIGHT_DEQUANT):
        super().__init__(weights, act_dtype, activation_quant)
        self.act_dtype = self.ops.act

    def prepare_all(self) -> None:
        for layer in range(self.cfg.num_hidden_layers):
            self.layer_weights(layer)
