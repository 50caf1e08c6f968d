"""The scheduler in a thread of its own, fed by the HTTP handlers.

Handlers (asyncio) submit requests into a thread-safe inbox and read their text from an asyncio queue each; the
scheduler's thread moves the inbox into the scheduler at every iteration, runs one iteration, and pushes the text
each token shows (decoded once, by the request's TextStream, in this thread) and then the end to its request's
queue with `call_soon_threadsafe`. Cancelling sets a flag the scheduler honours at
its next iteration, so the slot is free before the next step; a cancelled request stops counting as waiting at
once. A bounded queue of waiting requests makes the server refuse (429) instead of growing without bound.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from k2trt.errors import K2Error
from k2trt.runtime.generation.scheduler import Request, Scheduler


class QueueFull(K2Error):
    """More requests wait than the server accepts: retry later (HTTP 429)."""


class ShuttingDown(K2Error):
    """The server is stopping (HTTP 503)."""


@dataclass(frozen=True)
class End:
    """The last item of a request's queue: the last of its text (held back until the end)."""
    text: str = ""


@dataclass(eq=False)
class Handle:
    """One submitted request, as its handler sees it: the text of each token arrives in `texts` (often ""), then
    an End."""

    request: Request
    texts: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    token_times: list[float] = field(default_factory=list)

    def cancel(self) -> None:
        self.request.cancelled = True


class SchedulerThread:
    def __init__(self, scheduler: Scheduler, max_waiting: int = 256, idle_wait_s: float = 0.02,
                 on_error=None, keepalive_s: float = 10.0):
        self.scheduler = scheduler
        # called (in this thread) with each handle whose request finished, however it ended; the metrics set it
        self.on_done = None
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self.keepalive_s = keepalive_s  # an idle scheduler still steps this often (pipeline stages wait with a timeout)
        self.on_error = on_error  # called with the exception if the thread dies
        self._inbox: queue.SimpleQueue[Handle] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopping = False
        # every submitted request not yet finished, by id: added by the handlers, removed by this thread
        self._lock = threading.Lock()
        self._handles: dict[int, Handle] = {}
        self._thread = threading.Thread(target=self._loop, name="k2trt-scheduler", daemon=True)
        self.error: BaseException | None = None

    # ---- the handlers' side ----------------------------------------------------------------------------
    def start(self) -> "SchedulerThread":
        self._thread.start()
        return self

    @property
    def waiting(self) -> int:
        """Requests that wait for a slot: submitted, not yet admitted, not cancelled (a client that left frees its
        place in the queue at once, not at the scheduler's next iteration)."""
        with self._lock:
            return sum(1 for h in self._handles.values() if h.request.admitted_at is None and not h.request.cancelled)

    @property
    def running(self) -> int:
        return self.scheduler.running()

    def cache_counters(self):
        """The scheduler's prefix-cache and page counters (plain integers, read without stopping it)."""
        return self.scheduler.cache_counters()

    def spec_counters(self):
        """What speculative decoding proposed and kept (a copy, read without stopping the scheduler)."""
        c = self.scheduler.spec_counters
        return replace(c, accepted_per_pos=list(c.accepted_per_pos or []))

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Handle:
        """Queue a checked request (K2Error for a bad one, QueueFull, ShuttingDown) and return its handle."""
        if self._stopping or self.error is not None:
            raise ShuttingDown("the server is shutting down")
        self.scheduler.check(request)
        if self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting already")
        handle = Handle(request, asyncio.Queue(), loop)
        request.on_token = lambda req, tok, text, h=handle: self._push(h, text)
        request.on_finish = lambda req, text, h=handle: self._finished(h, text)
        with self._lock:
            self._handles[request.id] = handle
        self._inbox.put(handle)
        self._wake.set()
        return handle

    def _push(self, handle: Handle, item: str | End) -> None:
        if not isinstance(item, End):
            handle.token_times.append(time.monotonic())
        try:
            handle.loop.call_soon_threadsafe(handle.texts.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def abort_all(self) -> None:
        """Stop taking requests (503) and cancel every one submitted: each ends at the scheduler's next iteration
        (finish reason "cancelled"), so its handler can still answer it properly. Safe from any thread."""
        self._stopping = True
        for h in self._open():
            h.cancel()
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, cancel the ones in flight, end the thread."""
        self.abort_all()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and self.scheduler.has_work() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))

    # ---- the scheduler's thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        last_step = time.monotonic()
        try:
            while not self._stop.is_set():
                self._take_inbox()
                if self.scheduler.has_work():
                    self.scheduler.iteration()
                    last_step = time.monotonic()
                elif time.monotonic() - last_step > self.keepalive_s:
                    self.scheduler.keepalive()
                    last_step = time.monotonic()
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # a backend failure: every open request ends, the server reports it
            self.error = e
            for h in self._open():
                self._push(h, End())
            if self.on_error:
                self.on_error(e)

    def _open(self) -> list[Handle]:
        with self._lock:
            return list(self._handles.values())

    def _finished(self, handle: Handle, text: str) -> None:
        with self._lock:
            self._handles.pop(handle.request.id, None)
        if self.on_done:
            self.on_done(handle)
        self._push(handle, End(text))

    def _take_inbox(self) -> None:
        while True:
            try:
                handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            req = handle.request
            if self._stopping:
                req.cancelled = True
            self.scheduler.submit(req)
