"""Writes that never leave a half-written file: write to a temporary name beside the target, then rename.

Temporaries are hidden and named `.<target name>.<8 random characters>.tmp` (`.old` for a directory moved
aside), so a writer that was killed (SIGKILL, power loss) leaves names that the next writer of the same
directory recognizes and removes (`remove_temporaries`, called under the directory's writer lock).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

_TEMPORARY = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.(tmp|old)")


def temporary_name(target: Path, suffix: str = "tmp") -> Path:
    """A fresh hidden name beside `target` for a directory being built (or moved aside: suffix "old")."""
    return target.parent / f".{target.name}.{secrets.token_hex(4)}.{suffix}"


def remove_temporaries(folder: Path, target: str | None = None, recursive: bool = False) -> list[Path]:
    """Remove what killed writers left in `folder` (temporaries of `target` only, when given); -> what went.
    Only for a caller holding the folder's writer lock: a live writer's temporaries look the same."""
    gone = []
    for path in (Path(folder).rglob(".*") if recursive else Path(folder).glob(".*")):
        m = _TEMPORARY.fullmatch(path.name)
        if m is None or (target is not None and m["target"] != target):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        gone.append(path)
    return gone


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; on success it replaces the target in one rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode())
