"""Clients that leave, ask for what can never fit, or send a chunked body past the limit (issue 19, items 1, 3, 4
and 7's start-up checks).

A request is held exactly where the test needs it by the Gate (tests/servers.py): at the head of its prefill step
(prefilling: no token yet), after a few decode steps (decoding), or behind another request that holds the only slot
(waiting). Clients are raw sockets on 127.0.0.1, so a test can send a whole request and close the connection
without reading the answer, as a client that gave up does. Every wait is a poll with a deadline far above the work.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from servers import HANG_S, InProcessServer, metric, wait_until
from k2trt.tools.bench_serve import free_port

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


KEY = "hostile-test-key"


@pytest.fixture(params=[None, pytest.param(KEY, marks=pytest.mark.slow)], ids=["open", "with-a-key"])
def auth(request, monkeypatch) -> dict:
    """The hostile clients against an open server and against one behind an API key (set as K2TRT_API_KEY, which
    the server reads at start): the headers every request of the test sends."""
    if request.param is None:
        monkeypatch.delenv("K2TRT_API_KEY", raising=False)
        return {}
    monkeypatch.setenv("K2TRT_API_KEY", request.param)
    return {"authorization": f"Bearer {request.param}"}


def send(port: int, body: dict, auth: dict) -> socket.socket:
    """A whole POST /v1/completions on a connection of its own, answer unread."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in auth.items()).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n%s"
              b"content-length: %d\r\n\r\n%s" % (extra, len(data), data))
    return s


def disconnects(url: str, state: str) -> float:
    return metric(url, "k2trt:client_disconnects_total", f'{{state="{state}"}}')


def test_a_client_that_leaves_is_cancelled_waiting_prefilling_or_decoding(tiny_ckpt, tiny_export, auth):
    """One slot. A non-streamed request is held in its prefill step and a streamed one waits behind it; each client
    leaves; each request is cancelled while the gate is still closed (so the server saw the disconnect itself, not
    the request's end), the waiting one stops counting as waiting at once, and /metrics counts both by state. Then a
    request held after three steps (decoding) is left the same way, and the slot serves the next request."""
    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "1", "--max-queue", "2",
                         "--max-context", "4096") as s:
        s.gate.close()
        prefilling = send(s.port, BODY, auth)
        s.gate.wait_held()
        (held,) = s.scheduler.layout.order
        assert held.first_token_at is None
        waiting = send(s.port, {**BODY, "stream": True}, auth)
        wait_until(lambda: metric(s.url, "k2trt:num_requests_waiting") == 1, "the second request to wait")

        waiting.close()
        wait_until(lambda: metric(s.url, "k2trt:num_requests_waiting") == 0, "the waiting request to be dropped")
        assert disconnects(s.url, "waiting") == 1
        prefilling.close()
        wait_until(lambda: held.cancelled, "the prefilling request to be cancelled")
        assert disconnects(s.url, "prefilling") == 1
        assert s.gate.held == 1  # all of it seen while the step still waits at the gate

        passed = len(s.gate.batches)
        s.gate.allow(4)  # the cancelled request's step ends; three of the next request's steps pass
        decoding = send(s.port, BODY, auth)
        wait_until(lambda: len(s.gate.batches) == passed + 4 and s.gate.held == 1,
                   "three steps of the third request to pass and the next to wait at the gate")
        (third,) = s.scheduler.layout.order
        assert third.first_token_at is not None and not third.cancelled
        decoding.close()
        wait_until(lambda: third.cancelled, "the decoding request to be cancelled")
        assert disconnects(s.url, "decoding") == 1
        s.gate.open()
        r = httpx.post(s.url + "/v1/completions", json={**BODY, "max_tokens": 4}, headers=auth, timeout=HANG_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert held.finish_reason == third.finish_reason == "cancelled" and len(third.token_ids) <= 4
        # the non-streamed requests whose clients left are logged and counted as nginx's 499
        wait_until(lambda: metric(s.url, "k2trt:requests_total", '{endpoint="/v1/completions",status="499"}') == 2,
                   "the two 499s to be counted")


@pytest.mark.slow
def test_a_place_in_the_queue_is_free_as_soon_as_its_client_leaves(tiny_ckpt, tiny_export, auth):
    """The queue holds one: while the only slot stays held at the gate, a third request is 429; the waiting
    client leaves; a fourth is accepted at once — before the scheduler has run another iteration."""
    short = {**BODY, "max_tokens": 4}
    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "1", "--max-queue", "1") as s:
        s.gate.close()
        running = send(s.port, short, auth)
        s.gate.wait_held()
        waiting = send(s.port, short, auth)
        wait_until(lambda: metric(s.url, "k2trt:num_requests_waiting") == 1, "the second request to wait")
        assert httpx.post(s.url + "/v1/completions", json=short, headers=auth, timeout=HANG_S).status_code == 429
        waiting.close()
        wait_until(lambda: metric(s.url, "k2trt:num_requests_waiting") == 0, "the place to be free")
        fourth = send(s.port, short, auth)
        wait_until(lambda: metric(s.url, "k2trt:num_requests_waiting") == 1, "the fourth request to wait")
        assert s.gate.held == 1  # the scheduler is still in the step it was in
        s.gate.open()
        for sock in (running, fourth):
            answer = b""
            while b"completion_tokens" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
            sock.close()


def test_what_can_never_fit_is_400_not_429(tiny_ckpt, tiny_export, auth):
    short = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    with InProcessServer(tiny_ckpt, tiny_export, "--max-queue", "2") as s:
        url = s.url + "/v1/completions"
        r = httpx.post(url, json={**short, "prompt": "Hi", "n": 3}, headers=auth, timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "more than the 2" in r.json()["error"]["message"]
        r = httpx.post(url, json={**short, "prompt": ["a", "b", "c"]}, headers=auth, timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = httpx.post(url, json={**short, "prompt": ["a", "b"], "n": 1}, headers=auth, timeout=HANG_S)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_a_chunked_body_over_the_limit_is_413(tiny_ckpt, tiny_export, auth):
    """A chunked body has no length to refuse it by: it is counted as it comes, and answered as a sized one is."""
    with InProcessServer(tiny_ckpt, tiny_export, "--max-body", "1000") as s:
        def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'", "max_tokens": 1}'

        r = httpx.post(s.url + "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json", **auth}, timeout=HANG_S)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        sized = httpx.post(s.url + "/v1/completions", content=b"{" + b" " * 2000 + b"}",
                           headers={"content-type": "application/json", **auth}, timeout=HANG_S)
        assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"
        assert metric(s.url, "k2trt:requests_total", '{endpoint="/v1/completions",status="413"}') == 2


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2trt.cli", "serve", *args], capture_output=True, text=True,
                          timeout=HANG_S)


def test_start_up_failures_are_one_line_before_the_model_loads(tmp_path, capsys):
    """Checked before anything loads: the model path here does not even exist, and each error is still about the
    flag at fault, one line, status 2. The first case runs as a user runs it (a process of its own); the rest call
    the same entry point in this process (nothing here crosses a process boundary)."""
    from k2trt.cli import main

    missing = str(tmp_path / "no-model")
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        r = _serve("--model", missing, "--port", str(port))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("k2trt serve: error:") and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines
        cases = [
            (["--host", "no-such-host.invalid"], "does not resolve"),
            (["--max-body", "0"], "--max-body"),
            (["--max-body", "-1"], "--max-body"),
            (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
            (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
            (["--dist-timeout", "nan"], "--dist-timeout"),
            (["--dist-timeout", "inf"], "--dist-timeout"),
            (["--dist-timeout", "-5"], "--dist-timeout"),
        ]
        for extra, says in cases:
            rc = main(["serve", "--model", missing, *extra])
            cap = capsys.readouterr()
            lines = cap.err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and not cap.out, (extra, rc, cap)
            assert lines[0].startswith("k2trt serve: error:") and says in lines[0], (extra, lines)
    finally:
        taken.close()


def test_shutdown_answers_what_it_cuts_short(tiny_ckpt, tiny_export, capfd):
    """A shutdown (what SIGTERM asks uvicorn for) while a non-streamed and a streamed request run: after the grace
    time both are aborted — held at the gate until then, so neither can finish on any machine — and answered as the
    API says: the non-streamed one an error object (503), the streamed one a final chunk with finish_reason "abort"
    and [DONE]; nothing in the log is a traceback or uvicorn's task cancellation."""
    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "2", "--shutdown-timeout", "0.5",
                         "--max-context", "4096") as s:
        s.gate.allow(2)
        plain = send(s.port, BODY, {})
        streamed = send(s.port, {**BODY, "stream": True}, {})
        s.gate.wait_held()
        wait_until(lambda: len(s.scheduler.layout) == 2, "both requests to run")
        s.server.should_exit = True  # uvicorn's SIGTERM handler does just this
        wait_until(lambda: all(r.cancelled for r in s.scheduler.layout.order), "the grace time to end")
        s.gate.open()
        answers = []
        for sock in (plain, streamed):
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
            answers.append(out.decode())
        head, _, body = answers[0].partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 503"), answers[0]
        assert json.loads(body)["error"]["message"] == "the server shut down before the request finished"
        events = [line[len("data: "):] for line in answers[1].splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort", events[-2]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Cancel" not in err, err
