"""Files the project reads and writes: JSON (config.json, manifests) with one clear error for a missing file,
bad JSON or a value that is not an object, writes through a temporary name, and content hashes.

Every file we read from a user's directory is checked first: it must be a regular file (a symlink is fine
if it leads to one, as in the Hugging Face cache) of bounded size, so a FIFO cannot hang a command and
/dev/zero cannot fill memory; and a file *named* by another file (an index's shard, a manifest's graph)
must be a plain relative name inside its directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path, PurePosixPath

from k2trt.atomic import atomic_write_text
from k2trt.errors import K2Error

MiB = 1 << 20
# Metadata files (config.json, indexes, manifests, tokenizer files). K2's largest, its safetensors index,
# is about 11 MiB.
MAX_METADATA_BYTES = 64 * MiB

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_stat(path: Path, st: os.stat_result, limit: int | None, error) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {_kind(st.st_mode)}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"{path}: is {st.st_size:,} bytes, more than the {limit:,} a file of this kind may have")


def regular_file(path: str | Path, error=K2Error, missing: str | None = None) -> Path:
    """`path` if it is (or links to) a regular file; else one clear error.
    `missing` replaces the default message for a file that does not exist."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise error(missing or f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    _check_stat(path, st, None, error)
    return path


def _open_checked(path: Path, limit: int | None, error, missing: str | None) -> int:
    """A read-only descriptor of a regular file, opened without blocking and checked on the open file itself,
    so a FIFO or device swapped in after any earlier check is refused too, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(missing or f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    try:
        _check_stat(path, os.fstat(fd), limit, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | Path, limit: int = MAX_METADATA_BYTES, error=K2Error,
                 missing: str | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes."""
    path = Path(path)
    fd = _open_checked(path, limit, error, missing)
    chunks, size = [], 0
    try:
        while size <= limit:  # read one byte past the limit: a file that grew since fstat is caught
            chunk = os.read(fd, min(limit + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise error(f"{path}: grew past the {limit:,} bytes a file of this kind may have while being read")
    return b"".join(chunks)


def read_text(path: str | Path, limit: int = MAX_METADATA_BYTES, error=K2Error, missing: str | None = None) -> str:
    data = read_bounded(path, limit, error, missing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def parse_json(text: str, where: str, error=K2Error):
    """json.loads with every failure as one line: bad syntax, nesting too deep, an integer too long to convert."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise error(f"{where}: not valid JSON ({e})") from None


def read_json_object(path: Path, missing_hint: str, error=K2Error, limit: int = MAX_METADATA_BYTES) -> dict:
    path = Path(path)
    text = read_text(path, limit, error, missing=f"{path.parent}: no {path.name} ({missing_hint})")
    value = parse_json(text, str(path), error)
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value


def member(root: Path, name: object, where: str, error=K2Error) -> Path:
    """The path of a file that `where` (an index, a manifest) names inside `root`: a relative name of plain
    parts ("model-00001-of-000062.safetensors", "trt/head.onnx") — never absolute, never "..", so nothing a
    file names can point outside its directory."""
    parts = PurePosixPath(name).parts if isinstance(name, str) and name else ()
    if (not parts or parts[0] == "/" or any(p in (".", "..") for p in parts) or "\\" in name or "\0" in name
            or PurePosixPath(*parts).as_posix() != name):
        raise error(f"{where}: {name!r} is not a plain relative file name inside {root}")
    return Path(root, *parts)


def write_json(path: Path, value: dict) -> None:
    atomic_write_text(Path(path), json.dumps(value, indent=1) + "\n")


def sha256_file(path: Path, error=K2Error) -> str:
    path = Path(path)
    h = hashlib.sha256()
    with os.fdopen(_open_checked(path, None, error, None), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
