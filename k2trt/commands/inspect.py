"""The `k2trt inspect` command: its arguments, and the call into k2trt.tools.inspect_checkpoint."""

from __future__ import annotations

import argparse

from k2trt.hub import model_dir
from k2trt.tools import inspect_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", nargs="?", type=model_dir,
                        help="a checkpoint directory, or owner/name[@revision] from the Hugging Face cache")
    parser.add_argument("--preset", metavar="NAME", help="a built-in config instead (kimi-k2, kimi-k2-thinking, tiny, tiny-int4, tiny-k2.5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args) -> int:
    return inspect_checkpoint.run(args)
