"""From command-line choices to a ready (backend, tokenizer, generator): the one place that decides which
backend serves a request and checks that the checkpoint, graphs and engines belong together."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from k2trt.errors import K2Error

BACKENDS = ("ort", "trt", "torch")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (weights, config, tokenizer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--onnx", type=Path, help="export directory (k2trt export) for the ONNX Runtime backend")
    src.add_argument("--engines", type=Path, help="engine directory (k2trt build) for the TensorRT backend")
    p.add_argument("--backend", choices=BACKENDS,
                   help="default: trt with --engines, ort with --onnx, else the torch reference")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="ONNX Runtime providers, comma-separated (e.g. CUDAExecutionProvider,CPUExecutionProvider)")
    p.add_argument("--max-context", type=int, default=None,
                   help="refuse prompts + new tokens longer than this (default: the model's maximum)")


@dataclass
class Loaded:
    backend: object
    tokenizer: object
    checkpoint: object

    @property
    def config(self):
        return self.checkpoint.config


def choose_backend(args) -> str:
    name = args.backend or ("trt" if args.engines else "ort" if args.onnx else "torch")
    if name == "ort" and not args.onnx:
        raise K2Error("--backend ort needs --onnx DIR (run `k2trt export` first)")
    if name == "trt" and not args.engines:
        raise K2Error("--backend trt needs --engines DIR (run `k2trt build` first)")
    return name


def load(args) -> Loaded:
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.tokenizer import KimiTokenizer

    name = choose_backend(args)
    ckpt = Checkpoint.open(args.model)
    tok = KimiTokenizer.from_dir(args.model)
    if tok.vocab_size != ckpt.config.vocab_size:
        raise K2Error(f"{args.model}: tokenizer has {tok.vocab_size} ids but config.json says vocab_size "
                      f"{ckpt.config.vocab_size}")
    if name == "ort":
        from k2trt.runtime.ort_backend import OrtBackend

        backend = OrtBackend(args.onnx, ckpt, providers=args.providers.split(","))
    elif name == "trt":
        from k2trt.runtime.trt.backend import TrtBackend

        backend = TrtBackend(args.engines, ckpt)
    else:
        from k2trt.runtime.torch_backend import TorchBackend

        backend = TorchBackend(ckpt)
    if getattr(args, "prepare_weights", True) and hasattr(backend, "prepare_all"):
        backend.prepare_all()  # weights bound once, before any step is timed
    return Loaded(backend, tok, ckpt)


def make_generator(loaded: Loaded, max_context: int | None):
    from k2trt.runtime.generator import Generator

    return Generator(loaded.backend, loaded.config, stop_ids=tuple(loaded.tokenizer.stop_ids), max_context=max_context)
