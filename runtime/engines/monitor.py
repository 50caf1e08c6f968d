"""What TensorRT reports while it builds an engine, as progress lines.

TensorRT (>= 10.0) calls an IProgressMonitor: phase_start(name, parent, num_steps), step_complete(name, step) ->
bool (False cancels the build) and phase_finish(name), possibly from several threads (python/docstrings/infer/
pyCoreDoc.h, IProgressMonitorDoc). Phase names and their nesting change between TensorRT versions, so they are
shown as they come: each phase down to `max_depth` when it starts and when it finishes (with its time), and step
counts at most every `interval` seconds.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class BuildProgress:
    def __init__(self, label: str, write: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 interval: float = 5.0, max_depth: int = 2):
        self.label, self.write, self.clock, self.interval, self.max_depth = label, write, clock, interval, max_depth
        self._lock = threading.Lock()
        self._phases: dict[str, tuple[int, float, int]] = {}  # name -> (depth, start time, steps)
        self._last_step_line = -float("inf")

    def _line(self, depth: int, text: str) -> None:
        self.write(f"  {self.label}: {'  ' * depth}{text}")

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        with self._lock:
            depth = 0 if parent_phase is None or parent_phase not in self._phases else \
                self._phases[parent_phase][0] + 1
            self._phases[phase_name] = (depth, self.clock(), num_steps)
            if depth < self.max_depth:
                self._line(depth, f"{phase_name} ({num_steps} step{'s' if num_steps != 1 else ''})")

    def step_complete(self, phase_name: str, step: int) -> bool:
        with self._lock:
            depth, _, steps = self._phases.get(phase_name, (0, 0.0, 0))
            now = self.clock()
            if depth < self.max_depth and now - self._last_step_line >= self.interval:
                self._last_step_line = now
                self._line(depth, f"{phase_name}: {step + 1}/{steps}")
        return True  # never cancel

    def phase_finish(self, phase_name: str) -> None:
        with self._lock:
            depth, start, _ = self._phases.pop(phase_name, (0, self.clock(), 0))
            if depth < self.max_depth:
                self._line(depth, f"{phase_name} done in {self.clock() - start:.1f} s")


def progress_monitor(trt, progress: BuildProgress):
    """A trt.IProgressMonitor forwarding to `progress`, or None where this TensorRT has no such interface."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):
        def __init__(self):
            base.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            progress.phase_start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name, step):
            return progress.step_complete(phase_name, step)

        def phase_finish(self, phase_name):
            progress.phase_finish(phase_name)

    return Monitor()
