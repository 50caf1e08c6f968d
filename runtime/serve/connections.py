"""Connections bounded: how many the server keeps open, and how long a client may take to send its request.

uvicorn alone keeps every accepted connection for as long as its client likes while the request's headers or body
are incomplete, and accepts until the process runs out of file descriptors — then asyncio's accept() fails (a
traceback per retry) and every client stalls. So the server speaks HTTP through `bounded_protocol`, uvicorn's h11
protocol with two rules:

- at most `max_connections` open (by default below RLIMIT_NOFILE, `connection_budget`): one more is answered 503 at
  once and closed, so its descriptor is free again and accept() never fails;
- a request must arrive whole (headers and body) within `read_timeout_s` of its connection opening or of the
  previous response ending: else 408 (nothing read yet) or the connection closed (the app sees a disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from k2trt.errors import K2Error

LOG = logging.getLogger("k2trt.serve")
RESERVED_FDS = 64  # descriptors kept for everything but clients: logs, model files, pipeline sockets
# after the grace time, requests are aborted and answered; uvicorn cancels what is left this much later
SHUTDOWN_MARGIN_S = 5.0
REFUSED_LOG_EVERY_S = 10.0  # refusals are logged once per this many seconds, never once each


def check_listen(host: str, port: int) -> None:
    """Bind the address once, before the model loads: a host that does not resolve or a port in use is a one-line
    error now, not after minutes of loading. Bound as uvicorn will bind it (asyncio's create_server sets
    SO_REUSEADDR on POSIX), so a port only in TIME_WAIT passes and one another process listens on fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise K2Error(f"--host {host!r} does not resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise K2Error(f"cannot listen on {host}:{port}: {e.strerror}") from None


def raise_file_limit(wanted: int = 65536) -> int:
    """Raise this process's soft RLIMIT_NOFILE toward its hard limit (at most `wanted`); -> the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_budget(soft_limit: int, open_now: int, max_connections: int | None = None) -> tuple[int, int]:
    """(connections, listen backlog) that fit below the file limit. asyncio accepts up to `backlog` connections in
    one go before any of them can be refused, and a refused one's descriptor is freed a few loop turns later, so a
    few backlogs' worth is kept free besides RESERVED_FDS."""
    spare = soft_limit - open_now - RESERVED_FDS
    backlog = min(2048, max(8, spare // 8))
    cap = max(1, spare - 4 * backlog)
    return (cap if max_connections is None else max_connections), backlog


def _raw_response(status: int, reason: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


_BUSY = _raw_response(503, "Service Unavailable", b'{"error": {"message": "too many open connections; retry later",'
                      b' "type": "server_error", "param": null, "code": "too_many_connections"}}', "retry-after: 1\r\n")
_SLOW = _raw_response(408, "Request Timeout", b'{"error": {"message": "the request did not arrive in time",'
                      b' "type": "invalid_request_error", "param": null, "code": "request_timeout"}}')


def bounded_protocol(max_connections: int, read_timeout_s: float) -> type:
    """uvicorn's h11 protocol, bounded as the module says (a class: uvicorn makes one per connection)."""
    last_refusal_log = [0.0]

    class BoundedH11Protocol(H11Protocol):
        _read_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_BUSY)
                transport.close()
                now = time.monotonic()
                if now - last_refusal_log[0] > REFUSED_LOG_EVERY_S:
                    last_refusal_log[0] = now
                    LOG.warning("refusing connections: %d are open (--max-connections)", max_connections)
                return
            self._arm_read_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_read_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_read_timer()  # the next request on this connection gets the same time

        def _arm_read_timer(self) -> None:
            self._disarm_read_timer()
            self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                return  # the request arrived whole: the app may take as long as it needs
            if self.conn.our_state is h11.IDLE and self.conn.trailing_data[0]:
                self.transport.write(_SLOW)  # part of a request arrived and nothing was answered yet
            self.transport.close()  # a request the app was reading sees a disconnect

    return BoundedH11Protocol


def quiet_accept_errors(loop) -> None:
    """asyncio logs a traceback each time accept() fails for want of descriptors (and retries every second): log
    one line a while instead. Any other loop error goes to the default handler."""
    last = [0.0]

    def handle(loop, context):
        if context.get("message") != "socket.accept() out of system resource":
            return loop.default_exception_handler(context)
        now = time.monotonic()
        if now - last[0] > REFUSED_LOG_EVERY_S:
            last[0] = now
            LOG.warning("accept() failed: %s", context.get("exception"))

    loop.set_exception_handler(handle)


class BoundedServer(uvicorn.Server):
    """uvicorn's server, its event loop's accept() errors quieted (quiet_accept_errors), with a grace period that
    ends requests properly: on SIGTERM (or ^C) uvicorn stops accepting and waits `timeout_graceful_shutdown` for
    the requests in flight, then cancels their tasks (uvicorn/server.py `shutdown`) — a plain-text 500 or a cut
    stream, and a traceback each. So after `grace_s` this server calls `on_grace_over` (the scheduler thread's
    abort_all), whose requests end at the next step and are answered as the API says (an error object, or a final
    chunk and [DONE]); uvicorn's own limit is set SHUTDOWN_MARGIN_S later, time for that step and those writes."""

    def __init__(self, config, grace_s: float | None = None, on_grace_over=None):
        super().__init__(config)
        self.grace_s, self.on_grace_over = grace_s, on_grace_over

    async def serve(self, sockets=None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().serve(sockets)

    async def shutdown(self, sockets=None) -> None:
        if self.on_grace_over is not None:
            asyncio.get_running_loop().call_later(self.grace_s or 0.0, self.on_grace_over)
        await super().shutdown(sockets)
