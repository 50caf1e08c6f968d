"""Shared test helpers: the tiny checkpoint made once per session, and ways to damage copies of it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

from k2trt.tools.tiny import make_tiny

_TINY: dict[int, Path] = {}


def tiny_checkpoint(tmp_path_factory, seed: int = 0) -> Path:
    """The tiny checkpoint for this seed, written once per test session (a few seconds)."""
    if seed not in _TINY:
        _TINY[seed] = make_tiny(tmp_path_factory.mktemp(f"tiny-seed{seed}") / "ckpt", seed=seed)
    return _TINY[seed]


def clone(src: Path, dst: Path, copy: tuple[str, ...] = ()) -> Path:
    """A cheap copy of a checkpoint: symlinks, except the files named in `copy`, which are real copies
    (so a test can damage them without touching the session's checkpoint)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name in copy:
            shutil.copyfile(p, dst / p.name)
        else:
            (dst / p.name).symlink_to(p)
    return dst


def shard_of(ckpt: Path, name: str) -> str:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Edit a safetensors header in place (the data area is kept byte for byte)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + blob[8 + n:])
