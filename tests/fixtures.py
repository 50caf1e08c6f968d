"""Shared test helpers: the tiny checkpoint made once per session, and ways to damage copies of it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

from k2trt.tiny.checkpoint import make_tiny

_TINY: dict[tuple[int, str], Path] = {}


def tiny_checkpoint(tmp_path_factory, seed: int = 0, format: str = "fp8") -> Path:
    """The tiny checkpoint for this seed and format (make-tiny --format), written once per test session."""
    if (seed, format) not in _TINY:
        _TINY[seed, format] = make_tiny(tmp_path_factory.mktemp(f"tiny-{format}-seed{seed}") / "ckpt", seed=seed,
                                        format=format)
    return _TINY[seed, format]


def header_only_checkpoint(cfg, out: Path, n_shards: int = 62) -> Path:
    """A checkpoint directory with every tensor of `cfg` in its headers and no data: each shard's data area is a
    sparse hole (a 600 GB model takes no disk), but for the INT4 weight_shapes, whose values are written, since
    validation reads them. For published sizes (K2-Thinking's) without downloading them; the header is written as
    the safetensors format lays it out (JSON after its 8-byte length, offsets tiling the data area)."""
    import numpy as np

    from k2trt.checkpoint import INDEX_NAME
    from k2trt.checkpoint_writer import ordered_specs, shard_name, shard_plan
    from k2trt.dtypes import dtype as dtype_info

    out.mkdir(parents=True, exist_ok=True)
    specs_all = ordered_specs(cfg)
    by_name = {s.name: s for s in specs_all}
    plan = shard_plan(specs_all, n_shards)
    weight_map, prefix = {}, cfg.weight_prefix
    for i, specs in enumerate(plan):
        name = shard_name(i + 1, len(plan))
        header, offset, shapes = {"__metadata__": {"format": "pt"}}, 0, []
        for spec in specs:
            header[prefix + spec.name] = {"dtype": dtype_info(spec.dtype).safetensors, "shape": list(spec.shape),
                                          "data_offsets": [offset, offset + spec.nbytes]}
            if spec.name.endswith(".weight_shape"):
                packed = by_name[spec.name.removesuffix("shape") + "packed"]
                shapes.append((offset, [packed.shape[0], packed.shape[1] * packed.pack]))
            offset += spec.nbytes
            weight_map[prefix + spec.name] = name
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        start = 8 + len(blob)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for at, value in shapes:
                f.seek(start + at)
                f.write(np.asarray(value, np.int32).tobytes())
            f.truncate(start + offset)
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.write_json(out / "config.json")
    return out


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


def rewrite_tensors(ckpt: Path, shard: str, edit: Callable[[dict], None]) -> None:
    """Rewrite one shard of a clone (which must hold real copies of the shard and the index) with `edit`
    applied to its tensors, and make the index follow (removed names dropped, new names placed there)."""
    from k2trt.safetensors_io import load_file, save_file

    tensors = {k: v.clone() for k, v in load_file(ckpt / shard).items()}
    edit(tensors)
    (ckpt / shard).unlink()
    save_file(tensors, ckpt / shard)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = {k: v for k, v in index["weight_map"].items() if v != shard or k in tensors}
    wm.update({k: shard for k in tensors})
    index["weight_map"] = wm
    index_path.write_text(json.dumps(index))


def one_error_line(rc: int, err: str, command: str) -> str:
    """Assert the CLI's promise for bad input: a non-zero exit, one `k2trt COMMAND: error:` line on stderr and
    nothing else there (no traceback); returns the line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"k2trt {command}: error: "), err
    return lines[0]
