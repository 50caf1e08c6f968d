"""The `k2trt serve` command: its arguments, and the call into k2trt.runtime.entrypoints.serve."""

from __future__ import annotations

import argparse

from k2trt.args import at_least, non_negative_number, port, positive_number
from k2trt.runtime.entrypoints.model import add_model_arguments, add_pipeline_arguments
from k2trt.runtime.entrypoints import serve
from k2trt.runtime.entrypoints.serve import DEFAULT_MAX_BATCH
from k2trt.runtime.serve.security import API_KEY_ENV


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
    g = p.add_argument_group("access (rank 0 serves HTTP: checked there, before the model loads)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="every /v1 request must send 'Authorization: Bearer KEY' (repeat for rotation; also "
                        f"${API_KEY_ENV}, comma-separated); /health and /metrics stay open")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="... and this certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="require client certificates signed by these CAs (PEM)")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="browser origins allowed by CORS, comma-separated or repeated; '*' for any (default: none)")
    g.add_argument("--allowed-methods", action="append", default=None, metavar="METHODS",
                   help="methods CORS allows (default GET,POST)")
    g.add_argument("--allowed-headers", action="append", default=None, metavar="HEADERS",
                   help="request headers CORS allows (default Authorization,Content-Type)")
    add_pipeline_arguments(p)


def run(args) -> int:
    return serve.run(args)
