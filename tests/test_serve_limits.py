"""Connections bounded (issue 19, item 5): a request's headers and body that never arrive whole time out; open
connections are capped below the file limit, one more answered 503 at once; /metrics labels come from a fixed set.

Clients here are raw sockets on 127.0.0.1, so a test can send half a request. Every wait is a poll or a blocking
read with a hang guard far above the work; the short --read-timeout is the thing under test."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from k2trt.runtime.serve.metrics import ENDPOINTS, OTHER
from k2trt.runtime.serve.routes import router
from servers import HANG_S, InProcessServer, wait_until
from k2trt.tools.bench_serve import free_port


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    s.settimeout(HANG_S)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a hang guard of HANG_S per read)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_metrics_labels_are_a_fixed_set(tiny_ckpt, tiny_export):
    assert ENDPOINTS == {r.path for r in router.routes if r.path.startswith("/v1/")}
    with InProcessServer(tiny_ckpt, tiny_export) as s:
        for i in range(30):
            assert httpx.get(f"{s.url}/v1/invented-{i}", timeout=HANG_S).status_code == 404
        assert httpx.get(f"{s.url}/v1/models", timeout=HANG_S).status_code == 200
        text = httpx.get(s.url + "/metrics", timeout=HANG_S).text
    series = [line for line in text.splitlines() if line.startswith("k2trt:requests_total{")]
    assert f'k2trt:requests_total{{endpoint="{OTHER}",status="404"}} 30.0' in series, series
    assert 'k2trt:requests_total{endpoint="/v1/models",status="200"} 1.0' in series, series
    assert len(series) == 2, series


@pytest.mark.slow
def test_a_request_that_never_arrives_whole_times_out(tiny_ckpt, tiny_export, capfd):
    with InProcessServer(tiny_ckpt, tiny_export, "--read-timeout", "2") as s:
        headers = connect(s.port)  # headers that never end
        headers.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n")
        body = connect(s.port)  # a body shorter than it says
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\": ")
        silent = connect(s.port)  # a connection that says nothing
        try:
            assert read_all(headers).startswith(b"HTTP/1.1 408 "), "half-sent headers were not timed out"
            assert b"HTTP/1.1 200" not in read_all(body)  # closed: the route saw a disconnect
            assert read_all(silent) == b""
            # the server still answers, and a complete request is not cut by the timeout
            r = httpx.post(s.url + "/v1/completions", timeout=HANG_S,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        finally:
            for c in (headers, body, silent):
                c.close()
    assert "Traceback" not in capfd.readouterr().err


def test_connections_over_the_cap_are_refused_at_once(tiny_ckpt, tiny_export):
    with InProcessServer(tiny_ckpt, tiny_export, "--max-connections", "3", "--read-timeout", str(HANG_S * 5)) as s:
        held = [connect(s.port) for _ in range(3)]
        try:
            one_more = connect(s.port)
            answer = read_all(one_more)
            one_more.close()
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer, answer
            held.pop().close()  # a place frees up: a new client is served again
            wait_until(lambda: _health(s.url) == 200, "a freed connection to be taken again")
        finally:
            for c in held:
                c.close()


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=HANG_S).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.slow
def test_the_default_cap_stays_below_the_file_limit(tiny_ckpt, tiny_export):
    """`k2trt serve` under a file limit of 256, with 400 idle connections: the ones past the cap are refused at
    once (a new client gets a 503, never a stall), and the log has no accept() traceback."""
    limit = 256
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 2 * limit, "this test's own sockets need descriptors"
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "k2trt.cli", "serve", "--model", str(tiny_ckpt), "--onnx", str(tiny_export),
         "--port", str(port), "--log-level", "warning", "--read-timeout", str(HANG_S * 5)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    held: list[socket.socket] = []
    try:
        wait_until(lambda: proc.poll() is not None or _health(f"http://127.0.0.1:{port}") == 200, "the server")
        assert proc.poll() is None, _output(log)
        # opened many at a time: the listen backlog under this limit is ~20, and a SYN that finds it full is
        # resent after 1 s (TCP's initial RTO); opened one by one, each full backlog cost the test a second
        with ThreadPoolExecutor(32) as pool:
            held = list(pool.map(lambda _: connect(port), range(400)))
        probe = connect(port)  # past the cap: answered at once
        answer = read_all(probe)
        probe.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        for c in held:
            c.close()
        held = []
        wait_until(lambda: _health(f"http://127.0.0.1:{port}") == 200, "the server to serve again")
        out = _output(log)
        assert "Traceback" not in out and "accept" not in out, out[-3000:]
    finally:
        for c in held:
            c.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(HANG_S)
        log.close()


def _output(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()
