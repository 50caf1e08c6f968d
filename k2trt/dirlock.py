"""One writer per directory: an exclusive lock on the directory itself, and the temporaries of writers that were
killed removed before writing starts.

The lock is flock(2) on the directory's own descriptor, so it leaves no file behind and the kernel releases it
when its holder dies, however it dies: a killed export never blocks the next one. A second writer waits for
the first (saying so once) and then works on what the first left complete — two exports into one directory
never interleave, so the manifest always describes the graphs beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Iterator

from k2trt.atomic import remove_temporaries
from k2trt.errors import K2Error


@contextlib.contextmanager
def writer_lock(directory: Path, who: str, log=None) -> Iterator[None]:
    """Hold `directory`'s writer lock (it must exist). `who` names the writer in the waiting message."""
    directory = Path(directory)
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise K2Error(f"{directory}: cannot lock it for writing ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (log or (lambda msg: print(msg, file=sys.stderr, flush=True)))(
                f"{who}: another k2trt process is writing to {directory}; waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def writing(directory: Path, who: str, log=None) -> Iterator[None]:
    """Create `directory` if needed, hold its writer lock, and first remove what killed writers left in it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with writer_lock(directory, who, log):
        remove_temporaries(directory, recursive=True)
        yield
