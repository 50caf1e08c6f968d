"""A structured fuzzer for safetensors headers (hypothesis, fixed seed, a budget that fits CI).

Every file it makes — valid headers, valid headers with one field made hostile, arbitrary JSON, deep nesting,
integers of thousands of digits, duplicate keys, bad UTF-8, header lengths and data areas that lie — goes through
our reader and a checkpoint's validation. The only way out is a CheckpointError (one line); our reader accepts
only files the official library accepts (refusing on top only dimensions torch cannot index), and what it accepts
reads the same through both of our paths.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from k2trt.checkpoint import Checkpoint, CheckpointError
from k2trt.config import K2Config
from k2trt.dtypes import BY_SAFETENSORS
from k2trt.safetensors_io import SafetensorsFile

pytestmark = pytest.mark.slow

ITEMSIZE = {code: d.itemsize for code, d in BY_SAFETENSORS.items()}
CODES = sorted(ITEMSIZE) + ["F4", "F8_E8M0", "F8_E5M2FNUZ", "C64", "Q9", "f32", ""]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
names = st.text(min_size=0, max_size=6) | st.sampled_from(["__metadata__", "model.norm.weight"])


@st.composite
def valid_header(draw) -> tuple[dict, int]:
    """A header the format allows, and the size of its data area."""
    header, pos = {}, 0
    for name in draw(st.lists(names.filter(lambda n: n != "__metadata__"), max_size=4, unique=True)):
        code = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        if draw(st.integers(0, 9)) == 0:  # no elements, so any dimension fits in no bytes
            shape = [0, *shape, draw(st.sampled_from([2**62, 2**63 - 1, 2**63, 2**64 - 1]))]
        n = ITEMSIZE[code]
        for d in shape:
            n *= d
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    return header, pos


hostile_field = st.one_of(
    json_values,
    st.sampled_from(CODES),
    st.lists(st.integers(-3, 2**66) | st.floats() | st.booleans(), max_size=4),
    st.lists(st.integers(0, 3), max_size=3).map(lambda s: s + [2**64]),  # a dimension >= 2**64
    st.lists(st.integers(0, 3), max_size=2).map(lambda s: [0, *s, 2**63]),  # zero elements, huge dimension
)


@st.composite
def mutated_header(draw) -> tuple[dict, int]:
    """A valid header with one thing made hostile: a field of an entry, an entry, or the metadata."""
    header, size = draw(valid_header())
    where = draw(st.sampled_from(["field", "entry", "metadata", "extra"]))
    tensors = [k for k in header if k != "__metadata__"]
    if where == "field" and tensors:
        name = draw(st.sampled_from(tensors))
        header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(hostile_field)
    elif where == "entry" and tensors:
        header[draw(st.sampled_from(tensors))] = draw(json_values)
    elif where == "metadata":
        header["__metadata__"] = draw(json_values | st.sampled_from([False, "", [], 0]))
    else:
        header[draw(names)] = draw(json_values)
    return header, size + draw(st.sampled_from([0, 0, 0, 1, -1, 8]))


@st.composite
def header_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "json", "deep", "bigint", "duplicate", "utf8"]))
    if kind in ("valid", "mutated", "json"):
        strategy = {"valid": valid_header(), "mutated": mutated_header(),
                    "json": st.tuples(json_values, st.integers(0, 64))}[kind]
        header, size = draw(strategy)
        blob = json.dumps(header).encode()
    elif kind == "deep":
        depth = draw(st.integers(1, 100_000))
        blob, size = b'{"a":' + b"[" * depth + b"]" * depth + b"}", 0
    elif kind == "bigint":
        digits = draw(st.integers(20, 6000))
        blob = b'{"a":{"dtype":"F32","shape":[' + b"9" * digits + b'],"data_offsets":[0,4]}}'
        size = 4
    elif kind == "duplicate":
        key = draw(st.sampled_from(["__metadata__", "a"]))
        value = b'{}' if key == "__metadata__" else b'{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
        blob, size = b"{" + b",".join([b'"' + key.encode() + b'":' + value] * 2) + b"}", 1
    else:
        blob, size = b'{"\xff\xfe":' + draw(st.binary(max_size=8)) + b"}", 0
    blob += b" " * draw(st.integers(0, 7))
    length = len(blob) + draw(st.sampled_from([0, 0, 0, 0, -1, 1, 2**40, -len(blob)]))
    data = draw(st.binary(min_size=max(size, 0), max_size=max(size, 0)))
    return struct.pack("<Q", max(length, 0)) + blob + data


def official_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except Exception:  # noqa: BLE001 — any refusal of the official library counts as a refusal
        return False


def exercise(path: Path) -> bool:
    """Open, read every tensor both ways; True if the file was accepted. Only CheckpointError may escape."""
    try:
        f = SafetensorsFile(path)
    except CheckpointError as e:
        assert "\n" not in str(e)
        return False
    for name in f.names():
        info = f.info(name)
        assert isinstance(info.dtype_name, str) and all(isinstance(d, int) for d in info.shape)
        try:
            mapped, read = f.tensor(name), f.read(name)
        except CheckpointError as e:
            assert "\n" not in str(e)
            continue
        assert mapped.shape == read.shape and mapped.dtype == read.dtype == info.torch_dtype
        assert torch.equal(mapped.reshape(-1).view(torch.uint8), read.reshape(-1).view(torch.uint8))
    return True


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(blob=header_bytes())
def test_no_header_escapes_as_anything_but_one_line(blob):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "model.safetensors"
        path.write_bytes(blob)
        accepted = exercise(path)
        assert accepted <= official_accepts(path)
        if accepted:  # our checks against a config on top of the library's
            K2Config.preset("tiny").write_json(root / "config.json")
            try:
                Checkpoint.open(root).validate()
            except CheckpointError as e:
                assert "\n" not in str(e)
