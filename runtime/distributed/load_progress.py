"""Loading progress of every rank on rank 0's terminal: each rank writes its bytes bound so far into the store,
and rank 0 draws one line per rank (bytes, share, time left) until every rank is ready."""

from __future__ import annotations

import json
import sys
import threading
import time

from k2trt.runtime.distributed.world import World, read_key


def progress_key(rank: int) -> str:
    return f"k2trt/progress/{rank}"


def ready_key(rank: int) -> str:
    return f"k2trt/ready/{rank}"


class LoadReporter:
    """A Backend.prepare progress callback for one rank: items in prepare order -> bytes in the store."""

    def __init__(self, world: World, item_bytes: list[int]):
        self.world, self.item_bytes = world, item_bytes
        self.total = sum(item_bytes)
        self.start = time.monotonic()
        self._write(0)

    def _write(self, done: int) -> None:
        self.world.store.set(progress_key(self.world.rank), json.dumps(
            {"done": done, "total": self.total, "seconds": time.monotonic() - self.start}))

    def __call__(self, done_items: int, total_items: int, what: str) -> None:
        self._write(sum(self.item_bytes[:done_items]))

    def ready(self) -> None:
        self._write(self.total)
        self.world.store.set(ready_key(self.world.rank), "1")


def _eta(done: int, total: int, seconds: float) -> str:
    if done >= total:
        return "ready"
    if done <= 0 or seconds < 0.5:
        return "…"
    left = seconds * (total - done) / done
    return f"{left // 60:.0f}m{left % 60:02.0f}s left" if left >= 60 else f"{left:.0f}s left"


def rank_progress(world: World) -> list[tuple[str, float | None]]:
    """(line, share done or None before the rank reports) for every rank."""
    out = []
    for r in range(world.size):
        raw = read_key(world.store, progress_key(r))
        if raw is None:
            out.append((f"rank {r}: starting", None))
            continue
        p = json.loads(raw)
        share = p["done"] / p["total"] if p["total"] else 1.0
        out.append((f"rank {r}: {p['done'] / 1e9:.2f}/{p['total'] / 1e9:.2f} GB ({share:.0%}), "
                    f"{_eta(p['done'], p['total'], p['seconds'])}", share))
    return out


class ProgressBoard:
    """Rank 0's thread that redraws every rank's progress until stopped (a terminal), or prints a line per rank
    when it changes by a quarter (anything else). Loads that finish within `quiet_s` print nothing."""

    def __init__(self, world: World, stream=sys.stderr, interval: float = 0.5, quiet_s: float = 5.0):
        self.world, self.stream, self.interval = world, stream, interval
        self.tty = stream.isatty()
        self.speak_after = time.monotonic() + quiet_s
        self._stop = threading.Event()
        self._drawn = 0
        self._quarters: dict[int, int] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "ProgressBoard":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._draw()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        if time.monotonic() < self.speak_after and not self._drawn and not self._quarters:
            return
        rows = rank_progress(self.world)
        if self.tty:
            up = f"\033[{self._drawn}F" if self._drawn else ""
            self.stream.write(up + "".join(f"{line}\033[K\n" for line, _ in rows))
            self._drawn = len(rows)
        else:
            for r, (line, share) in enumerate(rows):
                q = -1 if share is None else int(share * 4)
                if q > self._quarters.get(r, -1):
                    self._quarters[r] = q
                    self.stream.write(line + "\n")
        self.stream.flush()
