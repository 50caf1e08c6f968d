"""`k2trt plan (--model DIR | --preset kimi-k2) --devices N --device-memory SIZE [--reserve SIZE]
[--max-context N --max-batch B] [--stages 8,8,…] [--json]`: how a pipeline splits the model over N devices.

Sizes are exact bytes: weights and scales from the checkpoint's safetensors headers (or the weight table for a
preset) plus each block's latent cache at the requested context and batch, plus a reserve per device. Prints one
table; an infeasible plan is refused (exit 1) with the smallest device count that would fit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k2trt.args import at_least
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.distributed import placement


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="checkpoint directory (sizes from its safetensors headers)")
    src.add_argument("--preset", help="a built-in config (kimi-k2, tiny): sizes from the weight table")
    p.add_argument("--devices", type=at_least(1), required=True, help="pipeline stages, one per device")
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 140GiB (H200), 79.6GiB (H100)")
    p.add_argument("--reserve", default=f"{placement.DEFAULT_RESERVE // 2**30}GiB",
                   help="kept free per device for the CUDA context, TensorRT scratch, NCCL, activations "
                        "(default %(default)s)")
    p.add_argument("--max-context", type=at_least(1), default=4096, help="positions per sequence to hold in the cache "
                                                                "(default 4096)")
    p.add_argument("--max-batch", type=at_least(1), default=1, help="sequences to hold in the cache (default 1)")
    p.add_argument("--stages", help="explicit blocks per stage, e.g. 8,8,8,8,8,7,7,7 (validated the same way)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def sized_items(args, cfg: K2Config) -> list[placement.Item]:
    cache = placement.cache_bytes_per_layer(cfg, args.max_context, args.max_batch)
    if args.model is None:
        return placement.items_from_config(cfg, cache)
    from k2trt.checkpoint import Checkpoint

    ckpt = Checkpoint.open(args.model)
    return placement.items_from_headers(cfg, ckpt.header_specs(), cache)


def render(plan: placement.Placement, source: str) -> str:
    rows = [("stage", "layers", "weight GB", "cache GB", "free GB")]
    rows += [(str(s.index), s.describe(), placement.format_gb(s.weight_bytes), placement.format_gb(s.cache_bytes),
              placement.format_gb(s.free)) for s in plan.stages]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]

    def line(r):  # names left, numbers right
        return "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    head = (f"{source}: {len(plan.stages)} stages, {placement.format_gb(plan.device_memory)} GB per device, "
            f"{placement.format_gb(plan.reserve)} GB reserved; heaviest stage {placement.format_gb(plan.heaviest.bytes)} GB")
    return "\n".join([head, "", line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]])


def as_json(plan: placement.Placement, source: str) -> dict:
    return {"source": source, "devices": len(plan.stages), "device_memory": plan.device_memory,
            "reserve": plan.reserve, "fits": plan.fits,
            "stages": [{"stage": s.index, "layers": s.layers, "embedding": s.first, "head": s.last,
                        "weight_bytes": s.weight_bytes, "cache_bytes": s.cache_bytes, "free_bytes": s.free}
                       for s in plan.stages]}


def run(args) -> int:
    cfg = K2Config.from_json(args.model) if args.model is not None else K2Config.preset(args.preset)
    memory = placement.parse_size(args.device_memory, "--device-memory")
    reserve = placement.parse_size(args.reserve, "--reserve")
    if reserve >= memory:
        raise K2Error(f"--reserve {args.reserve} leaves nothing of --device-memory {args.device_memory}")
    items = sized_items(args, cfg)
    counts = placement.parse_counts(args.stages) if args.stages else None
    plan = placement.place_stages(items, args.devices, memory, reserve, counts)
    source = str(args.model) if args.model is not None else f"{args.preset} (preset)"
    print(json.dumps(as_json(plan, source)) if args.json else render(plan, source))
    if plan.fits:
        return 0
    over = [s for s in plan.stages if s.free < 0]
    need = placement.smallest_fitting(items, memory, reserve, 1 if counts else args.devices + 1)
    fix = (f"the smallest device count that fits is {need}" if need is not None
           else "no device count fits: one block alone exceeds the device")
    raise K2Error(f"stage {over[0].index} needs {placement.format_gb(over[0].bytes)} GB, more than the "
                  f"{placement.format_gb(over[0].capacity)} GB a device has after the reserve; {fix}")
