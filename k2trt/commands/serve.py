"""The `k2trt serve` command: its arguments, and the call into k2trt.runtime.entrypoints.serve."""

from __future__ import annotations

import argparse

from k2trt.args import at_least, non_negative_number, port, positive_number
from k2trt.runtime.entrypoints.model import add_model_arguments, add_pipeline_arguments
from k2trt.runtime.entrypoints import serve
from k2trt.runtime.entrypoints.serve import DEFAULT_MAX_BATCH


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--max-batch", type=at_least(1), default=DEFAULT_MAX_BATCH,
                   help=f"sequence slots: requests decoded together (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--max-queue", type=at_least(1), default=256, help="waiting requests before 429 (default 256)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-body", type=at_least(1), default=4 << 20, help="largest request body in bytes (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=non_negative_number, default=10.0,
                   help="seconds in-flight requests may take to finish on SIGTERM (default 10)")
    p.add_argument("--max-connections", type=at_least(1), default=None,
                   help="open connections; one more is answered 503 (default: what the file limit leaves)")
    p.add_argument("--read-timeout", type=positive_number, default=30.0,
                   help="seconds a client may take to send a request's headers and body (default 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_pipeline_arguments(p)


def run(args) -> int:
    return serve.run(args)
