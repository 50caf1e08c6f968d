"""`k2trt export`: the per-block ONNX graphs (TensorRT-bound and ONNX Runtime forms) and their manifest.

Graphs hold no weights, so exporting real K2 takes seconds on a CPU: `--preset kimi-k2 --graphs-only`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.export import manifest as M
from k2trt.export.block_graphs import KINDS, activation_io, build_block_graph
from k2trt.export.checks import check_onnx, check_trt_operators
from k2trt.export.lower_ort import lower_for_ort
from k2trt.export.onnx_ops import ELEM, weight_prep
from k2trt.graphs.fp8 import PER_TOKEN_GROUP, WEIGHT_DEQUANT

ACT_QUANT = {"w8a8": PER_TOKEN_GROUP, "w8a16": WEIGHT_DEQUANT}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", choices=["kimi-k2", "tiny"], help="export a preset's graphs without a checkpoint")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="activation dtype of the graphs (float32 for CPU; bfloat16 for TensorRT on a GPU)")
    p.add_argument("--activation-quant", choices=list(ACT_QUANT), default="w8a8",
                   help="FP8 mode of the TensorRT-bound graphs' custom nodes (default w8a8, as vLLM/SGLang serve)")
    p.add_argument("--graphs-only", action="store_true",
                   help="do not validate the checkpoint's tensors against the config (graphs never hold weights)")
    p.add_argument("--force", action="store_true", help="re-export even if the graphs are up to date")


def run(args) -> int:
    if args.model is not None:
        cfg = K2Config.from_json(args.model)
        if not args.graphs_only:
            _validate_checkpoint(args.model)
    else:
        cfg = K2Config.preset(args.preset)
    export(cfg, args.out, args.dtype, ACT_QUANT[args.activation_quant], force=args.force)
    return 0


def _validate_checkpoint(model_dir: Path) -> None:
    from k2trt.checkpoint import Checkpoint

    Checkpoint.open(model_dir).validate()


def export(cfg: K2Config, out: Path, act_dtype: str = "float32", activation_quant: int = PER_TOKEN_GROUP,
           force: bool = False, log=print) -> dict:
    """Write trt/<kind>.onnx, ort/<kind>.onnx and manifest.json under `out`; returns the manifest."""
    if out.exists() and not out.is_dir():
        raise K2Error(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    previous = M.load_if_current(out, cfg, act_dtype, activation_quant)
    graphs: dict[str, dict] = {}
    t_all = time.perf_counter()
    for i, kind in enumerate(KINDS, 1):
        keys = (f"trt/{kind}", f"ort/{kind}")
        if not force and previous and all(M.entry_is_current(out, previous["graphs"].get(k)) for k in keys):
            for k in keys:
                graphs[k] = previous["graphs"][k]
            log(f"[{i}/{len(KINDS)}] {kind}: up to date")
            continue
        t0 = time.perf_counter()
        trt_model = build_block_graph(cfg, kind, act_dtype, activation_quant)
        check_onnx(trt_model, f"trt/{kind}")
        check_trt_operators(trt_model, f"trt/{kind}")
        ort_model, prep = lower_for_ort(trt_model, ELEM[act_dtype])
        check_onnx(ort_model, f"ort/{kind}")
        acts = {name for name, _, _ in activation_io(cfg, kind, act_dtype)[0]}
        graphs[keys[0]] = M.write_graph(out, keys[0], kind, "tensorrt", trt_model, weight_prep(trt_model),
                                        activation_quant, acts)
        # The lowering computes with dequantized weights: the W8A16 convention.
        graphs[keys[1]] = M.write_graph(out, keys[1], kind, "onnxruntime", ort_model, prep, WEIGHT_DEQUANT, acts)
        log(f"[{i}/{len(KINDS)}] {kind}: {len(trt_model.graph.node)} nodes, "
            f"{len(graphs[keys[0]]['weights'])} weight inputs ({time.perf_counter() - t0:.1f}s)")
    manifest = M.make_manifest(cfg, act_dtype, activation_quant, graphs)
    M.write_manifest(out, manifest)
    log(f"exported {len(KINDS)} block kinds to {out} in {time.perf_counter() - t_all:.1f}s")
    return manifest


if __name__ == "__main__":  # pragma: no cover
    from k2trt.cli import main

    sys.exit(main(["export", *sys.argv[1:]]))
