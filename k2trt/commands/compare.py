"""`k2trt compare --model DIR --onnx DIR [--engines DIR] [--backends ort,trt] [--layers ...] [--tokens N]`:
one table of every backend against the torch reference; exit 1 naming the failing blocks."""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.args import at_least
from k2trt.errors import K2Error
from k2trt.runtime.backends.factory import BackendChoice
from k2trt.tools.compare.compare import DEFAULT_TOKENS, Setup, compare
from k2trt.tools.compare.selection import parse_layers, prompt_ids
from k2trt.tools.compare.table import format_table
from k2trt.hub import model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_dir, required=True,
                   help="checkpoint directory (weights, config, tokenizer), or owner/name[@revision] from the HF cache")
    p.add_argument("--onnx", type=Path, required=True, help="export directory (k2trt export)")
    p.add_argument("--engines", type=Path, help="engine directory (k2trt build), for --backends trt")
    p.add_argument("--backends", help="comma-separated: ort, trt (default: ort, plus trt with --engines)")
    p.add_argument("--layers", help="comma-separated blocks: embedding, head, layer indices "
                                    "(default: embedding, the dense block, first/middle/last MoE block, head)")
    p.add_argument("--save-dir", type=Path, help="where the polygraphy files go (default: <onnx>/compare)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: two fixed prompts)")
    p.add_argument("--tokens", type=at_least(0), default=DEFAULT_TOKENS,
                   help=f"greedy tokens compared end to end (default {DEFAULT_TOKENS}; 0 = no end-to-end rows)")
    p.add_argument("--providers", default="CPUExecutionProvider", help="ONNX Runtime providers, comma-separated")


def backend_choices(args) -> tuple[BackendChoice, ...]:
    names = [b.strip() for b in (args.backends or ("ort,trt" if args.engines else "ort")).split(",") if b.strip()]
    unknown = [n for n in names if n not in ("ort", "trt")]
    if unknown:
        raise K2Error(f"--backends: unknown backend {unknown[0]!r} (choose from ort, trt)")
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return tuple(BackendChoice(n, onnx=args.onnx, engines=args.engines, providers=providers) for n in names)


def run(args) -> int:
    from k2trt.checkpoint import Checkpoint

    choices = backend_choices(args)
    ckpt = Checkpoint.open(args.model)
    setup = Setup(weights=ckpt, export_dir=args.onnx, prompts=prompt_ids(args.model, args.prompt, ckpt.config),
                  backends=choices, layers=parse_layers(args.layers, ckpt.config), tokens=args.tokens,
                  save_dir=args.save_dir)
    report = compare(setup)
    print(format_table(report.rows))
    print(report.summary())
    return 0 if report.passed else 1
