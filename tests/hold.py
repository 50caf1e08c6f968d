"""`python tests/hold.py WHERE -- K2TRT ARGS...`: run `k2trt ARGS` held at a chosen point, for a test that must
signal or kill a command exactly part-way, on any machine at any speed. On getting there the process prints
"held" on stdout and waits for a line on stdin (or for the signal the test sends); then it goes on.

  import:MODULE   inside the first import of MODULE (e.g. import:torch: the subcommand's heavy imports)
  write:N         in the N-th atomic write (k2trt/atomic.atomic_path), its temporary written, not yet renamed
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys


def hold() -> None:
    print("held", flush=True)
    sys.stdin.readline()


class HoldAtImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str):
        self.module, self.done = module, False

    def find_spec(self, name, path=None, target=None):
        if name == self.module and not self.done:
            self.done = True
            hold()
        return None  # the real finders import it


def hold_at_write(n: int) -> None:
    from k2trt import atomic

    real, count = atomic.atomic_path, [0]

    @contextlib.contextmanager
    def held_path(target):
        with real(target) as tmp:
            yield tmp
            count[0] += 1
            if count[0] == n:
                hold()

    atomic.atomic_path = held_path  # before any writer imports it by name


def main() -> int:
    where, sep, *argv = sys.argv[1:]
    assert sep == "--", __doc__
    kind, _, value = where.partition(":")
    if kind == "import":
        sys.meta_path.insert(0, HoldAtImport(value))
    elif kind == "write":
        hold_at_write(int(value))
    else:
        raise SystemExit(__doc__)
    from k2trt.cli import main as k2trt

    return k2trt(argv)


if __name__ == "__main__":
    sys.exit(main())
