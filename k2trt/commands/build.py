"""The `k2trt build` command: its arguments, and the call into k2trt.runtime.engines.builder."""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.runtime.tensorrt.profiles import add_profile_arguments
from k2trt.runtime.engines import builder
from k2trt.runtime.engines.builder import PLUGIN_MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--onnx", type=Path, required=True, help="export directory (written by `k2trt export`)")
    p.add_argument("--out", type=Path, required=True, help="engine directory to write")
    add_profile_arguments(p)
    p.add_argument("--timing-cache", type=Path,
                   help="TensorRT timing cache to read and update (speeds up rebuilds); one file per activation "
                        "dtype and FP8 mode: FILE.bfloat16-w8a8 and so on (FILE's suffix kept)")
    p.add_argument("--kinds", nargs="+", choices=BLOCK_KINDS + MOE_PART_KINDS, default=None,
                   help="build only these engines (default: every kind, and the MoE block's parts where the export "
                        "has them: --expert-parallel)")
    p.add_argument("--plugins", choices=PLUGIN_MODES, default="aot",
                   help="aot: plugin kernels compiled into the engine, which then runs without Python (default); "
                        "jit: Python calls the kernels at every enqueue (debugging)")
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")


def run(args) -> int:
    return builder.run(args)
