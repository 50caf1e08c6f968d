"""Streaming a checkpoint layer by layer keeps peak memory near one layer, whatever the checkpoint's size.

`python -m k2trt.tools.stream_bench --gb 4` (`make bench-stream`) writes a synthetic checkpoint of about that size
(K2's format; cheap constant weights), then streams every layer's block weights in a child process, touching
every byte, and reports the child's peak RSS against the size of one layer and of the checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from k2trt.args import positive_number
from k2trt.config import K2Config
from k2trt.checkpoint_writer import ordered_specs, write_checkpoint

MB = 1 << 20

def proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (VmRSS, VmHWM: the peak RSS)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    from k2trt.checkpoint import Checkpoint
    from k2trt.tools.stream_bench import proc_status as status

    ckpt = Checkpoint.open(sys.argv[1])
    ckpt.validate()
    base = status("VmHWM")
    checksum = 0
    for i in range(ckpt.config.num_hidden_layers):
        weights = ckpt.block_weights(i)
        for t in weights.values():  # touch every byte
            checksum += int(t.reshape(-1).view(torch.uint8).numpy().sum(dtype=np.uint64))
        del weights
    print(json.dumps({"base": base, "peak": status("VmHWM"), "checksum": checksum}))
""")


def streaming_config(gb: float) -> K2Config:
    """The tiny config at hidden 256 / expert width 256 (~75 MB a MoE layer), with as many layers as `gb` needs."""
    one = dataclasses.replace(K2Config.preset("tiny"), hidden_size=256, moe_intermediate_size=256,
                              num_hidden_layers=2)
    layer = sum(s.nbytes for s in ordered_specs(one) if s.name.startswith("model.layers.1."))
    return dataclasses.replace(one, num_hidden_layers=max(2, math.ceil(gb * 1e9 / layer)))


def fill(i: int) -> int:
    return i % 97 + 1


def constant_tensors(cfg: K2Config):
    """Cheap stand-in weights (a constant byte per tensor), so the reader's checksum can be checked exactly."""
    for i, spec in enumerate(ordered_specs(cfg)):
        raw = torch.full((spec.nbytes,), fill(i), dtype=torch.uint8)
        yield spec.name, raw.view(getattr(torch, spec.dtype)).reshape(spec.shape)


def measure(cfg: K2Config, directory: Path) -> dict:
    """Write the checkpoint to `directory`, stream it in a child; sizes and peaks in bytes."""
    specs = ordered_specs(cfg)
    write_checkpoint(directory, cfg, constant_tensors(cfg), n_shards=cfg.num_hidden_layers)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(directory)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"streaming child failed: {proc.stderr.strip().splitlines()[-1]}")
    got = json.loads(proc.stdout)
    layer_bytes = [sum(s.nbytes for s in specs if s.name.startswith(f"model.layers.{i}."))
                   for i in range(cfg.num_hidden_layers)]
    return {
        "checkpoint": sum(s.nbytes for s in specs), "layer": max(layer_bytes),
        "baseline": got["base"], "peak": got["peak"], "checksum": got["checksum"],
        "expected_checksum": sum(fill(i) * s.nbytes for i, s in enumerate(specs)
                                 if s.name.startswith("model.layers.")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2trt.tools.stream_bench", description=__doc__)
    p.add_argument("--gb", type=positive_number, default=4.0, help="checkpoint size in GB (default 4)")
    p.add_argument("--dir", type=Path, help="where to write it (default: a temporary directory, removed after)")
    args = p.parse_args(argv)
    cfg = streaming_config(args.gb)
    print(f"writing a {args.gb:g} GB checkpoint ({cfg.num_hidden_layers} layers) and streaming it ...", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        r = measure(cfg, Path(tmp))
    ok = r["checksum"] == r["expected_checksum"]
    print(f"{'checkpoint':>12}{'one layer':>12}{'baseline':>12}{'peak RSS':>12}{'growth':>12}  checksum")
    print(f"{r['checkpoint'] / MB:>10.0f}MB{r['layer'] / MB:>10.0f}MB{r['baseline'] / MB:>10.0f}MB"
          f"{r['peak'] / MB:>10.0f}MB{(r['peak'] - r['baseline']) / MB:>10.0f}MB  {'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
