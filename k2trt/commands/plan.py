"""The `k2trt plan` command: its arguments, and the call into k2trt.tools.plan."""

from __future__ import annotations

import argparse

from k2trt.args import at_least, int_in
from k2trt.hub import model_dir
from k2trt.runtime.distributed import placement, roofline
from k2trt.tools import plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=model_dir, help="checkpoint directory (sizes from its safetensors headers), "
                     "or owner/name[@revision] from the HF cache")
    src.add_argument("--preset", help="a built-in config (kimi-k2, kimi-k2-thinking, tiny, ...): sizes from the "
                     "weight table")
    p.add_argument("--devices", type=at_least(1), help="devices in all (with --layout)")
    p.add_argument("--layout", choices=("pp", "auto", "compare"), default=None,
                   help="with --devices: pp = pipeline stages only (default); auto = the fitting layout with the "
                        "shortest decode step; compare = every layout of N devices side by side")
    p.add_argument("--pipeline", type=at_least(1), help="pipeline stages P")
    p.add_argument("--expert-parallel", type=at_least(1), help="expert-parallel ranks E per stage "
                   "(each holds 1/E of every MoE block's routed experts and the rest whole)")
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 141GB (H200), 79.6GiB (H100)")
    p.add_argument("--reserve", default=f"{placement.DEFAULT_RESERVE // 2**30}GiB",
                   help="kept free per device for the CUDA context, TensorRT scratch, NCCL, activations "
                        "(default %(default)s)")
    p.add_argument("--max-context", type=at_least(1), default=4096,
                   help="positions per sequence to hold in the cache (default 4096)")
    p.add_argument("--max-batch", type=at_least(1), default=1,
                   help="sequences decoding together, over all ranks (default 1)")
    p.add_argument("--stages", help="explicit blocks per stage, e.g. 8,8,8,8,8,7,7,7 (validated the same way)")
    g = p.add_argument_group("the roofline of a decode step")
    g.add_argument("--hbm-bandwidth", default="4.8TB", metavar="BYTES/S",
                   help="device memory bandwidth (default 4.8TB: NVIDIA's H200 datasheet, HBM3e)")
    g.add_argument("--link-bandwidth", default="450GB", metavar="BYTES/S",
                   help="one way between devices of a node (default 450GB: the H200 datasheet's NVLink 900 GB/s "
                        "counts both ways)")
    g.add_argument("--network-bandwidth", default="50GB", metavar="BYTES/S",
                   help="one way per device between nodes (default 50GB: one 400 Gb/s InfiniBand NDR adapter per "
                        "GPU, as in NVIDIA's DGX H200)")
    g.add_argument("--node-size", type=int_in(1, 1024), default=roofline.NODE_SIZE,
                   help="devices per node (default %(default)s, an HGX H200)")
    g.add_argument("--all-to-all-latency", type=float, default=None, metavar="US",
                   help="least time of one MoE block's dispatch + combine, microseconds (default: DeepEP's "
                        "low-latency kernels for the EP size, from its V1 performance table: 191 µs at EP 8, 313 at "
                        "EP 16, ...)")
    g.add_argument("--hop-latency", type=float, default=roofline.HOP_LATENCY_S * 1e6, metavar="US",
                   help="latency of one pipeline hop, microseconds (default %(default).0f: an NCCL point-to-point "
                        "send)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args) -> int:
    return plan.run(args)
