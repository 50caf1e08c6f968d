"""Streaming every layer's block weights keeps peak memory near one layer, not the checkpoint's size."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from k2trt.config import K2Config
from k2trt.tiny import ordered_specs, spec_bytes, write_checkpoint

MB = 1 << 20

# ~0.85 GB: 12 layers (11 MoE) of 384 experts at hidden 256 / expert width 256, ~75 MB a layer.
BIG = dataclasses.replace(K2Config.preset("tiny"), hidden_size=256, moe_intermediate_size=256,
                          num_hidden_layers=12)


def _fill(i: int) -> int:
    return i % 97 + 1


def _constant_tensors(cfg: K2Config):
    """Cheap stand-in weights (a constant byte per tensor), so the reader's sum can be checked exactly."""
    for i, spec in enumerate(ordered_specs(cfg)):
        dtype = getattr(torch, spec.dtype)
        raw = torch.full((spec_bytes(spec),), _fill(i), dtype=torch.uint8)
        yield spec.name, raw.view(dtype).reshape(spec.shape)


CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    from k2trt.checkpoint import Checkpoint

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

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


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_streaming_all_layers_keeps_one_layer_resident(tmp_path):
    specs = ordered_specs(BIG)
    write_checkpoint(tmp_path, BIG, _constant_tensors(BIG), n_shards=BIG.num_hidden_layers)
    total = sum(spec_bytes(s) for s in specs)
    layer = max(sum(spec_bytes(s) for s in specs if s.name.startswith(f"model.layers.{i}."))
                for i in range(BIG.num_hidden_layers))
    expected = sum(_fill(i) * spec_bytes(s) for i, s in enumerate(specs) if s.name.startswith("model.layers."))
    assert 0.8e9 < total < 1.0e9

    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["checksum"] == expected
    peak, grew = got["peak"], got["peak"] - got["base"]
    print(f"checkpoint {total / MB:.0f} MB, layer {layer / MB:.0f} MB, baseline {got['base'] / MB:.0f} MB, "
          f"peak {peak / MB:.0f} MB (+{grew / MB:.0f} MB while streaming)")
    assert grew < 2.5 * layer
    assert peak < 2.5 * layer + 400 * MB
    assert peak < total / 2
