"""The torch reference as a backend: the same interface, so generation through it is the reference."""

from __future__ import annotations

from typing import Iterable

import torch

from k2trt.graphs.fp8 import WEIGHT_DEQUANT
from k2trt.graphs.reference import ReferenceModel
from k2trt.runtime.backends.contract import BackendLimits, Progress, WeightSource, prepare_each


class TorchBackend(ReferenceModel):
    name = "torch"
    device = torch.device("cpu")  # the reference computes on the CPU, in float32 by default
    limits = BackendLimits()
    reads_pages = True  # every step attends through the MlaPaged* nodes, the pool read in place

    def __init__(self, weights: WeightSource, act_dtype: str = "float32", activation_quant: int = WEIGHT_DEQUANT,
                 expert_parallel: int = 1):
        super().__init__(weights, act_dtype, activation_quant)
        self.act_dtype = self.ops.act
        self.expert_parallel = expert_parallel  # the weights hold one rank's experts: MoE layers run as parts

    def prepare(self, layers: Iterable[int] | None = None, *, embedding: bool = True, head: bool = True,
                progress: Progress | None = None) -> None:
        prepare_each(self._bind, self.cfg, layers, embedding, head, progress)

    def _bind(self, item: int | str, kind: str) -> None:
        if isinstance(item, int):
            self.layer_weights(item)
        else:
            self._globals(*self.global_names[item])

    def session_seconds(self) -> None:
        return None  # eager torch: the backend calls are the computation

    def draft_runner(self, draft, target_embedding) -> None:
        return None  # the reference computes a draft on its math, as the drafter does without a runner

    def standalone_onnx(self, kind: str, layer: int | None) -> None:
        return None
