"""Command-line values checked where they are declared (argparse types), so an out-of-range number is the
parser's one-line error before any work, in every command that takes it."""

from __future__ import annotations

import argparse
from typing import Callable

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in low..high."""
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


seed = int_in(0, MAX_SEED)
