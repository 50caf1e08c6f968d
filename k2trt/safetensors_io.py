"""Safetensors files through the official library (`safetensors.safe_open`: Rust, fuzzed upstream).

The library parses and checks each header — JSON syntax, dtypes, shapes, offsets that tile the data area, a
file that holds them all — so a damaged or hostile header is refused by the same code every other tool runs;
we turn its refusal into one line naming the file, and check the tensors against the config on top
(k2trt/checkpoint.py). Tensors come two ways: `tensor` is zero-copy from the library's memory map; `read` uses
its pread backend, so streaming a whole checkpoint leaves nothing mapped and nothing resident but what the
caller keeps (`make bench-stream`). Writing goes through `safetensors.torch.save_file`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from k2trt.dtypes import BY_SAFETENSORS
from k2trt.errors import K2Error
from k2trt.files import regular_file


class CheckpointError(K2Error):
    """A checkpoint that is missing, truncated, corrupt or does not match the config."""


MAX_SPAN = 2**63 - 1  # torch sizes and strides are signed 64-bit


def _span(shape: tuple[int, ...]) -> int:
    """The product of the dimensions, a 0 counted as 1: the largest stride torch computes for the shape."""
    n = 1
    for d in shape:
        n *= max(d, 1)
    return n

# The official library's words for its refusals, and what they mean for a file on disk.
_HINTS = {
    "incomplete metadata": "the file is shorter than its header says (truncated?)",
    "invalid offset": "the header's data offsets do not tile the data area (a header that lies?)",
    "header too large": "not a safetensors file (its first 8 bytes are not a plausible header length)",
    "header too small": "not a safetensors file (too short)",
}


def _refusal(path: Path, e: Exception) -> CheckpointError:
    msg = str(e).removeprefix("Error while deserializing header: ").strip().splitlines()[0]
    hint = next((h for key, h in _HINTS.items() if key in msg), None)
    return CheckpointError(f"{path}: {hint + ': ' if hint else ''}{msg}")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, as the official library read it."""

    name: str
    dtype: str  # safetensors code, e.g. "F8_E4M3"
    shape: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        """Our (torch's) spelling, as the weight table uses it; the safetensors code for a type we do not use."""
        known = BY_SAFETENSORS.get(self.dtype)
        return known.name if known else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        known = BY_SAFETENSORS.get(self.dtype)
        if known is None:
            raise CheckpointError(f"tensor {self.name!r}: dtype {self.dtype} is not one k2trt reads")
        return known.torch


class SafetensorsFile:
    """One .safetensors file. Opening reads and checks the header only; data is read or mapped on first use."""

    def __init__(self, path: str | Path):
        self.path = regular_file(path, CheckpointError)
        self._handles = {"pread": self._open("pread")}
        header = self._handles["pread"]
        self.metadata: dict[str, str] = header.metadata() or {}
        self.infos: dict[str, TensorInfo] = {}
        for name in header.offset_keys():
            view = header.get_slice(name)
            shape = tuple(view.get_shape())
            if _span(shape) > MAX_SPAN:  # the library allows any 64-bit sizes when another dimension is 0
                raise CheckpointError(f"{self.path}: tensor {name!r}: shape {list(shape)} is beyond what torch "
                                      f"can index (strides past 2**63)")
            self.infos[name] = TensorInfo(name, view.get_dtype(), shape)

    def _open(self, backend: str):
        try:
            return safe_open(os.fspath(self.path), framework="pt", backend=backend)
        except SafetensorError as e:
            raise _refusal(self.path, e) from None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror or e})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None

    def _get(self, backend: str, name: str) -> torch.Tensor:
        self.info(name).torch_dtype  # a type we do not read is refused by name, before the library sees it
        if backend not in self._handles:
            self._handles[backend] = self._open(backend)
        try:
            return self._handles[backend].get_tensor(name)
        except (SafetensorError, OSError) as e:  # the file changed under us (truncated while reading)
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot read it ({str(e).splitlines()[0]})") from None

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy view of the file's bytes, from the library's memory map."""
        return self._get("mmap", name)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the tensor read with plain file reads (never mapped), into `out` or a new tensor: streaming a
        whole checkpoint this way leaves nothing resident but what the caller keeps."""
        info = self.info(name)
        if out is not None and (tuple(out.shape) != info.shape or out.dtype != info.torch_dtype
                                or not out.is_contiguous()):
            raise ValueError(f"{name}: output buffer {out.dtype} {list(out.shape)} does not fit "
                             f"{info.dtype_name} {list(info.shape)}")
        src = self._get("pread", name)
        if out is None:
            return src
        # byte copies through NumPy: torch's element copy is slow for float8 on the CPU
        np.copyto(_bytes(out), _bytes(src))
        return out

    def close(self) -> None:
        """Drop our handles; tensors already handed out keep their memory until they go."""
        self._handles.clear()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def load_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file, zero-copy."""
    f = SafetensorsFile(path)
    return {name: f.tensor(name) for name in f.names()}


def save_file(tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write with the official library (format metadata "pt", as HF checkpoints carry)."""
    from safetensors.torch import save_file as _save

    _save(dict(tensors), os.fspath(path), metadata={"format": "pt", **(metadata or {})})
