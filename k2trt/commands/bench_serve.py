"""The `k2trt bench-serve` command: its arguments, and the call into k2trt.tools.bench_serve."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from k2trt.args import at_least, int_list
from k2trt.hub import model_dir
from k2trt.tools.serve_scenarios import SCENARIOS
from k2trt.tools import bench_serve


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=model_dir, help="checkpoint directory (or owner/name from the HF cache): start a server for it")
    src.add_argument("--url", help="a running k2trt (or other OpenAI-compatible) server instead")
    p.add_argument("--onnx", type=Path, help="export directory for the started server")
    p.add_argument("--engines", type=Path, help="engine directory for the started server")
    p.add_argument("--served-model-name", default=None, help="the model name to send (default: asked of the server)")
    p.add_argument("--concurrency", type=int_list(1), default=[1, 4, 16],
                   help="comma-separated concurrency levels (default 1,4,16)")
    p.add_argument("--requests", type=at_least(1), default=32, help="requests per level (default 32)")
    p.add_argument("--seed", type=int, default=0,
                   help="draws the prompts: each level and the warm-up get their own (default 0); another seed sends "
                        "prompts a server has not seen in an earlier run")
    p.add_argument("--prompt-len", type=at_least(1), default=64, help="prompt tokens (default 64)")
    p.add_argument("--max-tokens", type=at_least(2), default=32,
                   help="tokens generated per request (default 32; at least 2, for an inter-token latency)")
    p.add_argument("--structured", action="store_true",
                   help="also run each level under a json_schema grammar, and report its cost against plain requests")
    p.add_argument("--scenario", choices=SCENARIOS, default=None,
                   help="instead of the concurrency levels: a conversation resent every turn (multi-turn), or "
                        "--requests requests sharing a prefix (shared-prefix), each against a control of the same "
                        "length that shares nothing; or the paged cache's peak for one long sequence beside "
                        "--requests - 1 short ones (long-and-short)")
    p.add_argument("--turns", type=at_least(1), default=10, help="multi-turn: turns of the conversation (default 10)")
    p.add_argument("--turn-tokens", type=at_least(1), default=200,
                   help="multi-turn: new tokens per turn; shared-prefix: each request's own suffix; long-and-short: "
                        "the short prompts (default 200)")
    p.add_argument("--prefix-tokens", type=at_least(1), default=2000,
                   help="shared-prefix: tokens the requests share; long-and-short: the long prompt (default 2000)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                   help="the --url server's API key, sent as a bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args) -> int:
    return bench_serve.run(args)
