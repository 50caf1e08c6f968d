"""Command-line values checked where they are declared (argparse types), so an out-of-range number is the
parser's one-line error before any work, in every command that takes it. A rule that also applies elsewhere
(a request's sampling values, checked by runtime/generation/sampling.py) is written once there and handed to
`checked`, so the flag and the API refuse the same values with the same words."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, TypeVar

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit value

T = TypeVar("T")


def checked(parse: Callable[[str], T], problem: Callable[[T], str | None], kind: str) -> Callable[[str], T]:
    """An argparse type: the text parsed by `parse` (a ValueError is "expected KIND"), then refused with the
    message `problem(value)` returns, if it returns one."""
    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        message = problem(value)
        if message:
            raise argparse.ArgumentTypeError(message)
        return value

    convert.__name__ = kind  # argparse names the type in its own messages
    return convert


def integer(text: str) -> int:
    """An integer in decimal (leading zeros too), or as Python writes it (0x10, 1_000)."""
    try:
        return int(text)
    except ValueError:
        return int(text, 0)


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in low..high."""
    return checked(integer, lambda v: None if low <= v <= high else f"must be in {low}..{high}, got {v}",
                   "an integer")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""
    return checked(integer, lambda v: None if v >= low else f"must be >= {low}, got {v}", "an integer")


# An argparse type: a finite number > 0.
positive_number = checked(float, lambda v: None if math.isfinite(v) and v > 0 else f"must be a finite number > 0, "
                                                                                 f"got {v}", "a number")

# An argparse type: a finite number >= 0 (0: no grace at all).
non_negative_number = checked(float, lambda v: None if math.isfinite(v) and v >= 0 else
                              f"must be a finite number >= 0, got {v}", "a number")


def int_list(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each >= low (e.g. batch sizes "1,4,16")."""
    def parse(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v.strip()]

    def problem(values: list[int]) -> str | None:
        if not values:
            return "expected at least one integer"
        return None if min(values) >= low else f"expected integers >= {low}, got {','.join(map(str, values))}"

    return checked(parse, problem, "comma-separated integers")


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _byte_count(text: str) -> int:
    """Bytes as a number and an optional unit: 4GiB, 512MiB, 1.5G, 1e9, 1000000 (k/M/G/T: powers of 1000)."""
    t = text.strip().lower().removesuffix("b")
    number = t.rstrip("kmgti")
    unit = t[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(text)
    try:
        return int(float(number) * _UNITS[unit])
    except OverflowError:  # inf
        raise ValueError(text) from None


@dataclass(frozen=True)
class FreeShare:
    """A share of the device's free memory (`90%`), made bytes once the device is known (as vLLM's
    --gpu-memory-utilization, but of what is free when the model has loaded)."""
    fraction: float

    def of(self, free_bytes: int) -> int:
        return int(free_bytes * self.fraction)

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


def _size_or_share(text: str) -> int | FreeShare:
    t = text.strip()
    if t.endswith("%"):
        return FreeShare(float(t[:-1]) / 100)
    return _byte_count(t)


def _size_or_share_problem(v: int | FreeShare) -> str | None:
    if isinstance(v, FreeShare):
        return None if 0 < v.fraction <= 1 else f"must be a share in (0%, 100%] of free memory, got {v}"
    return None if v > 0 else f"must be > 0 bytes, got {v}"


# An argparse type: a size in bytes (> 0), or a share of the device's free memory ("90%").
memory_size = checked(_size_or_share, _size_or_share_problem, "a size in bytes (e.g. 8GiB) or a share of free memory "
                      "(e.g. 90%)")

seed = int_in(0, MAX_SEED)
port = int_in(0, 65535)
