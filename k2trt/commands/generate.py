"""The `k2trt generate` command: its arguments, and the call into k2trt.runtime.entrypoints.generate."""

from __future__ import annotations

import argparse

from k2trt.runtime.entrypoints.model import add_model_arguments, add_pipeline_arguments
from k2trt.runtime.entrypoints import generate
from k2trt.runtime.entrypoints.sampling_args import add_sampling_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", help="raw text, continued as is (repeat for a batch)")
    p.add_argument("--chat", action="append", help="a user message, wrapped in the chat template (repeatable)")
    add_sampling_arguments(p)
    p.add_argument("--tools", metavar="FILE.json", default=None,
                   help="tools the --chat model may call: a JSON list in the OpenAI API's shape")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_pipeline_arguments(p)


def run(args) -> int:
    return generate.run(args)
