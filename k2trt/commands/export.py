"""`k2trt export`: the per-block ONNX graphs and their manifest (export/exporter.py does the work).

Graphs hold no weights, so exporting real K2 takes seconds on a CPU: `--preset kimi-k2 --graphs-only`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.args import at_least
from k2trt.config import PRESETS, K2Config
from k2trt.hub import model_dir
from k2trt.export.exporter import export
from k2trt.graphs.fp8 import PER_TOKEN_GROUP, WEIGHT_DEQUANT

ACT_QUANT = {"w8a8": PER_TOKEN_GROUP, "w8a16": WEIGHT_DEQUANT}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=model_dir,
                     help="checkpoint directory (config.json + safetensors), or owner/name[@revision] from the HF cache")
    src.add_argument("--preset", choices=list(PRESETS), help="export a preset's graphs without a checkpoint")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="activation dtype of the graphs (float32 for CPU; bfloat16 for TensorRT on a GPU)")
    p.add_argument("--activation-quant", choices=list(ACT_QUANT), default="w8a8",
                   help="FP8 mode of the TensorRT-bound graphs' custom nodes (default w8a8, as vLLM/SGLang serve)")
    p.add_argument("--expert-ranges", type=int, default=1, metavar="N",
                   help="split the TensorRT form's routed experts into N ranges of weight inputs, each under 2^31 "
                        "elements (K2: 3), for a TensorRT that refuses larger plugin inputs (k2trt doctor says)")
    p.add_argument("--expert-parallel", type=at_least(1), default=1, metavar="E",
                   help="also export each MoE block split at the dispatch for E expert-parallel ranks (attention + "
                        "router + shared expert; one rank's 1/E of the routed experts; the combine), for "
                        "`--expert-parallel E` at run time")
    p.add_argument("--graphs-only", action="store_true",
                   help="do not validate the checkpoint's tensors against the config (graphs never hold weights)")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="also export this EAGLE-3 draft's graphs (fc, its decoder layer, head), for "
                        "--speculative-config eagle3 on the exported graphs: a directory or owner/name in the HF "
                        "cache, read against the target")
    p.add_argument("--force", action="store_true", help="re-export even if the graphs are up to date")


def run(args) -> int:
    if args.model is not None:
        cfg = K2Config.from_json(args.model)
        if not args.graphs_only:
            from k2trt.checkpoint import Checkpoint

            Checkpoint.open(args.model).validate()
    else:
        cfg = K2Config.preset(args.preset)
    draft = None
    if args.draft is not None:
        from k2trt.draft import load_draft

        draft = load_draft(args.draft, cfg)
    export(cfg, args.out, args.dtype, ACT_QUANT[args.activation_quant], force=args.force,
           expert_ranges=args.expert_ranges, expert_parallel=args.expert_parallel, draft=draft)
    return 0
