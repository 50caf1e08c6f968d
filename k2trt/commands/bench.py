"""The `k2trt bench` command: its arguments, and the call into k2trt.tools.bench."""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.args import at_least, int_list
from k2trt.hub import model_dir
from k2trt.tools import bench
from k2trt.tools.bench import REFERENCE, TRANSFORMERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_dir, required=True)
    p.add_argument("--onnx", type=Path, required=True)
    p.add_argument("--batch", type=int_list(1), default=[1, 4, 16], help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int_list(1), default=[16, 128, 512], help="prompt lengths, comma-separated")
    p.add_argument("--new-tokens", type=at_least(1), default=16)
    p.add_argument("--repeat", type=at_least(1), default=3,
                   help="timed runs of every backend per row (median reported)")
    p.add_argument("--baselines", default=f"{TRANSFORMERS},{REFERENCE}",
                   help=f"comma-separated: {TRANSFORMERS} (needs the bench extra), {REFERENCE} (eager torch)")
    p.add_argument("--json", action="store_true")
    from k2trt.runtime.entrypoints.model import add_pipeline_arguments, speculative_config

    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='the runtime speculates, as `generate` takes it (e.g. {"method": "ngram", '
                        '"num_speculative_tokens": 3}): its rows are against the baselines decoding plainly, and '
                        "report the tokens each verify step gave")

    # --pipeline P / --expert-parallel E: the per-step time of the ranks against one process (pipeline_bench)
    add_pipeline_arguments(p, micro_batch_list=True)


def run(args) -> int:
    return bench.run(args)
