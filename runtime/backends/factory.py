"""The one place backends are made: from a BackendChoice (what the user asked for) and a weight source. generate,
chat, bench, compare, the pipeline stages and the server all call `open_backend`; the backend modules are imported
here, lazily, so a command that never touches TensorRT never imports it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from k2trt.errors import K2Error
from k2trt.runtime.backends.contract import Backend, WeightSource

BACKENDS = ("ort", "trt", "torch")


@dataclass(frozen=True)
class BackendChoice:
    name: str  # one of BACKENDS
    onnx: Path | None = None  # export directory (ort; trt: checks the engines against it when given)
    engines: Path | None = None  # engine directory (trt)
    providers: tuple[str, ...] = ("CPUExecutionProvider",)  # ONNX Runtime execution providers
    threads: int | None = None  # ONNX Runtime intra-op threads (None: its default)
    device: int = 0  # CUDA device index (trt)
    expert_parallel: int = 1  # E > 1: one expert-parallel rank's backend (its MoE layers bound as their parts)

    def __post_init__(self):
        if self.name not in BACKENDS:
            raise K2Error(f"unknown backend {self.name!r} (choose from {', '.join(BACKENDS)})")
        if self.name == "ort" and self.onnx is None:
            raise K2Error("--backend ort needs --onnx DIR (run `k2trt export` first)")
        if self.name == "trt" and self.engines is None:
            raise K2Error("--backend trt needs --engines DIR (run `k2trt build` first)")

    @property
    def uses_cuda(self) -> bool:
        """Whether it computes on a CUDA device (pipeline ranks then talk over NCCL, one device each)."""
        return self.name == "trt"

    def for_rank(self, local_rank: int, threads: int) -> "BackendChoice":
        """The choice for one of several ranks on a machine: its own device, or its share of the cores."""
        if self.uses_cuda:
            return replace(self, device=local_rank)
        return replace(self, threads=self.threads or threads)


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--onnx", type=Path, help="export directory (k2trt export) for the ONNX Runtime backend")
    src.add_argument("--engines", type=Path, help="engine directory (k2trt build) for the TensorRT backend")
    p.add_argument("--backend", choices=BACKENDS,
                   help="default: trt with --engines, ort with --onnx, else the torch reference")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="ONNX Runtime providers, comma-separated (e.g. CUDAExecutionProvider,CPUExecutionProvider)")


def choice_from_args(args) -> BackendChoice:
    name = args.backend or ("trt" if args.engines else "ort" if args.onnx else "torch")
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return BackendChoice(name, onnx=args.onnx, engines=args.engines, providers=providers)


def open_backend(choice: BackendChoice, weights: WeightSource, *, activation_quant: int | None = None) -> Backend:
    """The chosen backend over `weights`. activation_quant only applies to the torch reference (its FP8
    convention is a choice; the other backends compute in the convention their graphs were exported with)."""
    if choice.name == "ort":
        from k2trt.runtime.backends.ort import OrtBackend

        return OrtBackend(choice.onnx, weights, providers=list(choice.providers), threads=choice.threads,
                          expert_parallel=choice.expert_parallel)
    if choice.name == "trt":
        from k2trt.runtime.backends.tensorrt import TrtBackend

        return TrtBackend(choice.engines, weights, export_dir=choice.onnx, device=choice.device,
                          expert_parallel=choice.expert_parallel)
    from k2trt.graphs.fp8 import WEIGHT_DEQUANT
    from k2trt.runtime.backends.torch_reference import TorchBackend

    return TorchBackend(weights, activation_quant=WEIGHT_DEQUANT if activation_quant is None else activation_quant,
                        expert_parallel=choice.expert_parallel)
