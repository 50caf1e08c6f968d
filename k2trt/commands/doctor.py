"""The `k2trt doctor` command: its arguments, and the call into k2trt.tools.doctor."""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.tools import doctor


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plugins", choices=("aot", "jit"), default="aot",
                   help="the plugin implementation to check (default aot, what `k2trt build` uses)")
    p.add_argument("--keep", type=Path, help="keep the tiny model's graphs and engines in this directory")


def run(args) -> int:
    return doctor.run(args)
