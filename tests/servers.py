"""Servers for the tests, and holds that keep their requests in flight on any machine at any speed.

- `Server`: `k2trt serve` in a child process (bench_serve.LiveServer), with the official openai client; its log
  is an unnamed temporary file, so nothing is left behind.
- `InProcessServer`: the same server (commands/serve.make_server: the arguments, scheduler thread, app and uvicorn
  of `k2trt serve`) in a thread of the test process, over a backend wrapped by a `Gate`, so a test can hold a
  step in flight exactly as long as it needs and look at the scheduler itself.
- `wait_until`: poll a state with a deadline (a hang guard far above the work), never a fixed sleep.
"""

from __future__ import annotations

import argparse
import re
import threading
import time

import httpx
import openai

from k2trt.runtime.backends.contract import BackendWrapper
from k2trt.tools.bench_serve import LiveServer, free_port

HANG_S = 120.0  # no state a test waits for takes this long, on any machine


def wait_until(predicate, what: str, timeout_s: float = HANG_S, every_s: float = 0.01):
    """Poll predicate() until it returns something true (which is returned); fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"still waiting after {timeout_s:.0f} s for {what}"
        time.sleep(every_s)


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of /metrics (0 when the series does not exist yet)."""
    text = httpx.get(url + "/metrics", timeout=HANG_S).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def official_client(url: str) -> openai.OpenAI:
    """OpenAI's client, retrying nothing (a test sees every error), on a fresh connection per request: a kept-alive
    one the server closes as idle just as the client reuses it ("Server disconnected without sending a response",
    seen on a loaded machine) is HTTP/1.1's race, which a client without retries must not run."""
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=HANG_S)
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S, http_client=http)


class Server(LiveServer):
    """A live `k2trt serve` on the embedded tiny checkpoint, with the official client pointed at it."""

    def __init__(self, ckpt, onnx, *extra):
        super().__init__(["--model", str(ckpt), "--onnx", str(onnx), "--served-model-name", "tiny", *extra],
                         startup_s=HANG_S * 1.5)
        self.client = official_client(self.url)

    def stop(self) -> int:
        code = super().stop()
        assert code is not None, "server did not stop on SIGTERM:\n" + self.output()
        return code


class Gate(BackendWrapper):
    """A backend whose head (the end of every step that samples) waits while the gate is closed: the requests of
    that step stay running, for as long as the test needs. `allow(n)` lets n more steps through and then holds;
    `close()` holds at the next; `open()` lets everything through. Every head call's batch is recorded."""

    def __init__(self, inner):
        super().__init__(inner)
        self._cond = threading.Condition()
        self._allowance: int | None = None  # None: open
        self.held = 0  # head calls waiting now
        self.batches: list[int] = []  # the sampled rows of each step that passed

    def head(self, hidden):
        with self._cond:
            while self._allowance == 0:
                self.held += 1
                self._cond.notify_all()
                opened = self._cond.wait(HANG_S)
                self.held -= 1
                assert opened, "the gate stayed closed: a test forgot to open it"
            if self._allowance is not None:
                self._allowance -= 1
            self.batches.append(hidden.shape[0])
        return self.inner.head(hidden)

    def allow(self, steps: int) -> None:
        with self._cond:
            self._allowance = steps
            self._cond.notify_all()

    def close(self) -> None:
        self.allow(0)

    def open(self) -> None:
        with self._cond:
            self._allowance = None
            self._cond.notify_all()

    def wait_held(self) -> None:
        """Until a step waits at the gate."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.held > 0, HANG_S), "no step reached the gate"


class InProcessServer:
    def __init__(self, ckpt, onnx, *serve_args: str):
        from k2trt.runtime.backends.factory import BackendChoice, open_backend
        from k2trt.commands import serve as serve_command
        from k2trt.runtime.entrypoints import serve
        from k2trt.runtime.entrypoints.model import LoadedModel, open_model

        parser = argparse.ArgumentParser()
        serve_command.add_arguments(parser)
        self.port = free_port()
        args = parser.parse_args(["--model", str(ckpt), "--onnx", str(onnx), "--served-model-name", "tiny",
                                  "--log-level", "warning", "--port", str(self.port), *serve_args])
        checkpoint, tokenizer = open_model(ckpt)
        self.tokenizer = tokenizer
        self.gate = Gate(open_backend(BackendChoice("ort", onnx=onnx), checkpoint))
        self.server, self.scheduler_thread = serve.make_server(args, LoadedModel(self.gate, tokenizer, checkpoint))
        self.url = f"{'https' if args.ssl_certfile else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self._thread.start()
        wait_until(lambda: self.server.started or not self._thread.is_alive(), "the server to start")
        assert self.server.started, "the in-process server did not start"
        self.client = official_client(self.url)

    @property
    def scheduler(self):
        return self.scheduler_thread.scheduler

    def stop(self) -> None:
        self.gate.open()
        self.server.should_exit = True
        self._thread.join(HANG_S)
        self.scheduler_thread.stop()
        assert not self._thread.is_alive(), "the in-process server did not stop"

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
