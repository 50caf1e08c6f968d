"""Our own safetensors reader: header parsed and checked by us, tensors zero-copy from a memory map.

File layout: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the data area;
offsets are relative to the data area. Writing goes through the official `safetensors.torch.save_file`, so
what we write is what every other tool reads.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from k2trt.dtypes import BY_SAFETENSORS
from k2trt.errors import K2Error


class CheckpointError(K2Error):
    """A checkpoint that is missing, truncated, corrupt or does not match the config."""


MAX_HEADER_BYTES = 100 * 1024 * 1024  # the official library's limit


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; begin/end are offsets into the data area."""

    name: str
    dtype: str  # safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype_name(self) -> str:
        """Our (torch's) spelling, as the weight table uses it."""
        return BY_SAFETENSORS[self.dtype].name

    @property
    def torch_dtype(self) -> torch.dtype:
        return BY_SAFETENSORS[self.dtype].torch

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file. Opening reads and checks the header only; the data is mapped on first use."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, self.infos, self.data_start = read_header(self.path)
        self._map: np.memmap | None = None
        self._fd: int | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of the file's bytes (copy-on-write: in-place changes never reach the file)."""
        info = self.info(name)
        if self._map is None:
            # Mode "c" maps privately, so the array is writable and torch does not warn.
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        raw = self._map[self.data_start + info.begin:self.data_start + info.end]
        return torch.from_numpy(raw).view(info.torch_dtype).reshape(info.shape)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the tensor read with plain file reads into `out` (or a new tensor), never mapped:
        streaming a whole checkpoint this way leaves nothing resident but what the caller keeps."""
        info = self.info(name)
        if out is None:
            out = torch.empty(info.shape, dtype=info.torch_dtype)
        elif tuple(out.shape) != info.shape or out.dtype != info.torch_dtype or not out.is_contiguous():
            raise ValueError(f"{name}: output buffer {out.dtype} {list(out.shape)} does not fit "
                             f"{info.dtype_name} {list(info.shape)}")
        if info.nbytes == 0:
            return out
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        done = 0
        while done < info.nbytes:
            n = os.preadv(self._fd, [buf[done:]], self.data_start + info.begin + done)
            if not n:
                raise CheckpointError(f"{self.path}: tensor {name!r}: file ended after {done} of "
                                      f"{info.nbytes} bytes (truncated while reading?)")
            done += n
        return out

    def close(self) -> None:
        """Drop our reference to the map; tensors already handed out keep it alive until they go."""
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


def read_header(path: Path) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    """Parse and check a file's header -> (__metadata__, name -> TensorInfo, data area start)."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: {msg}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"only {size} bytes: not a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise bad(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt file?)")
            if 8 + n > size:
                raise bad(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
            blob = f.read(n)
    except FileNotFoundError:
        raise bad("no such file") from None
    except OSError as e:
        raise bad(f"cannot read: {e.strerror}") from None
    try:
        raw = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise bad("header is not a JSON object")

    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise bad("__metadata__ must map strings to strings")

    data_size = size - 8 - n
    infos = {name: _parse_entry(path, name, entry, data_size) for name, entry in raw.items()}
    # Tensors must tile the data area exactly: no overlap, no hole, nothing after the last one
    # (the official library insists on the same).
    pos, prev = 0, None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin < pos:
            raise bad(f"tensor {info.name!r} (bytes {info.begin}-{info.end}) overlaps tensor {prev!r}")
        if info.begin > pos:
            raise bad(f"tensor {info.name!r} starts at byte {info.begin}, leaving a hole after byte {pos}")
        pos, prev = info.end, info.name
    if pos != data_size:
        raise bad(f"{data_size - pos} bytes after the last tensor in the data area (corrupt header?)")
    return metadata, infos, 8 + n


def _parse_entry(path: Path, name: str, entry: object, data_size: int) -> TensorInfo:
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r}: {msg}")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in BY_SAFETENSORS:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    need = numel * BY_SAFETENSORS[dtype].itemsize
    begin, end = offsets
    if end - begin != need:
        raise bad(f"data_offsets {offsets} span {end - begin} bytes but {dtype} {shape} needs {need}")
    if end > data_size:
        raise bad(f"data ends at byte {end} but the file's data area has only {data_size} bytes "
                  f"(truncated file or a header that lies)")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def load_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file, zero-copy."""
    f = SafetensorsFile(path)
    return {name: f.tensor(name) for name in f.names()}


def save_file(tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write with the official library (format metadata "pt", as HF checkpoints carry)."""
    from safetensors.torch import save_file as _save

    _save(dict(tensors), os.fspath(path), metadata={"format": "pt", **(metadata or {})})
