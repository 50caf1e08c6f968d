"""`k2trt serve --model DIR (--onnx DIR | --engines DIR) [--host 127.0.0.1 --port 8000] [--max-batch N]
[--max-context N] [--cache-memory SIZE] [--no-prefix-cache] [--pipeline N]`: an OpenAI-compatible server with continuous batching (runtime/serve/app.py).

The model loads as for generate (one process, or pipeline stages with rank 0 serving HTTP), the scheduler runs in
a thread of its own (serve/scheduler_thread.py), uvicorn serves. SIGTERM or ^C stops taking requests, lets those
in flight finish for up to --shutdown-timeout seconds, cancels the rest and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys

from k2trt.errors import K2Error
from k2trt.runtime.entrypoints.model import launch_if_asked, load_model

DEFAULT_MAX_BATCH = 16


def run(args) -> int:
    try:
        import uvicorn  # noqa: F401
        import fastapi  # noqa: F401
    except ImportError:
        raise K2Error("serving needs fastapi and uvicorn (pip install 'k2trt[serve]')") from None
    from k2trt.runtime.serve.connections import check_listen
    from k2trt.runtime.serve.security import access_from_args, open_to_the_network

    check_listen(args.host, args.port)  # before the model loads (and before any pipeline rank starts)
    access = access_from_args(args)  # keys, TLS files and origins, checked as early
    warning = open_to_the_network(args.host, access)
    if warning and _speaks_for_the_server():
        print(warning, file=sys.stderr, flush=True)
    launched = launch_if_asked(args)
    if launched is not None:
        return launched
    loaded = load_model(args, command="serve")
    if loaded.follower:
        loaded.session.follow()
        return 0
    try:
        return serve(args, loaded, access)
    finally:
        loaded.close()


def _speaks_for_the_server() -> bool:
    """One process says what concerns the listening server: this one alone, our launcher (before its ranks start),
    or torchrun's rank 0 (the rank that listens)."""
    import os

    from k2trt.runtime.distributed.launcher_link import launched, under_launcher

    return not launched() or (not under_launcher() and os.environ.get("RANK", "0") == "0")


def make_server(args, loaded, access=None):
    """The uvicorn server of `k2trt serve` for these arguments over this model, and its scheduler thread
    (started): what `serve` runs, and what a test runs in a thread of its own."""
    import uvicorn

    from k2trt.runtime.distributed.world import DEFAULT_TIMEOUT_S
    from k2trt.runtime.serve.connections import (SHUTDOWN_MARGIN_S, BoundedServer, bounded_protocol,
                                                 connection_budget, open_fds, raise_file_limit)
    from k2trt.runtime.serve.app import create_app
    from k2trt.runtime.serve.scheduler_thread import SchedulerThread
    from k2trt.runtime.serve.security import access_from_args
    from k2trt.runtime.serve.serving import ServeConfig, Serving

    limits = loaded.limits(args.max_context, args.max_batch, cache_memory=args.cache_memory)
    scheduler = loaded.scheduler(limits, prefix_cache=args.prefix_cache, speculation=args.speculative_config)
    server_box = []
    keepalive = min(10.0, (args.dist_timeout or DEFAULT_TIMEOUT_S) / 4)  # idle pipeline stages must hear from us
    scheduler_thread = SchedulerThread(scheduler, max_waiting=args.max_queue, keepalive_s=keepalive,
                                       on_error=lambda e: server_box and setattr(server_box[0], "should_exit", True))
    name = args.served_model_name or str(args.model)
    access = access or access_from_args(args)  # `run` checked it before the model loaded
    app = create_app(Serving(scheduler_thread.start(), loaded.tokenizer,
                             ServeConfig(name, scheduler.limits.max_context, args.max_body)), access)
    cap, backlog = connection_budget(raise_file_limit(), open_fds(), args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S, access_log=False,
                            http=bounded_protocol(cap, args.read_timeout), backlog=backlog, **access.tls)
    server_box.append(BoundedServer(config, grace_s=args.shutdown_timeout, on_grace_over=scheduler_thread.abort_all))
    return server_box[0], scheduler_thread


def serve(args, loaded, access=None) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    server, scheduler_thread = make_server(args, loaded, access)
    # uvicorn stops gracefully on SIGINT/SIGTERM, then raises the signal again for the handlers it found: ours
    # note it, so that a requested stop ends with status 0 (SIGTERM) or 130 (^C) instead of dying by the signal.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, frame: received.append(s))
    try:
        server.run()
    finally:
        scheduler_thread.stop()
    if scheduler_thread.error is not None:
        raise K2Error(f"the scheduler stopped: {scheduler_thread.error}")
    return 130 if signal.SIGINT in received else 0
