"""A K2 checkpoint directory: config.json plus safetensors shards (an HF index, or one model.safetensors).

Tensors are read lazily: a shard's header is parsed the first time one of its tensors (or the header
itself) is needed, and its data is memory-mapped only when a tensor is asked for. `block_weights` instead
copies one layer with plain reads, so streaming all 61 layers keeps only one layer resident.

Every tensor handed out — by `tensor`, `layer`, `globals` or `block_weights` — is first checked against the
weight table (graphs/weights.py): a tensor the config names must have exactly its shape and dtype, so nothing
downstream (ONNX Runtime, TensorRT, the reference) ever sees a tensor that `validate` would refuse. INT4 weights
also carry their logical shape (`weight_shape`), whose values `validate` and `check_tensors` read and check.

Names are the text model's (`model.layers.N....`, as graphs/weights.py names them); a K2.5 checkpoint stores them
under `language_model.` (K2Config.weight_prefix) beside a vision tower, whose tensors `other_tensors` lists and
nothing loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from k2trt.config import K2Config
from k2trt.dtypes import DTYPES
from k2trt.files import member, read_json_object, regular_file
from k2trt.graphs.weights import (SHAPE, TensorSpec, assemble_block_weights, checkpoint_specs, global_specs,
                                  layer_prefix, layer_specs, weight_formats)
from k2trt.safetensors_io import CheckpointError, SafetensorsFile

__all__ = ["Checkpoint", "CheckpointError", "HeaderSpec", "INDEX_NAME", "SINGLE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HeaderSpec(NamedTuple):
    dtype: str  # torch dtype name, as in graphs/weights.py ("float8_e4m3fn", "bfloat16", "float32", ...)
    shape: tuple[int, ...]
    shard: str  # file name inside the checkpoint directory

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


def _nbytes(dtype: str, shape) -> int:
    n = DTYPES[dtype].itemsize if dtype in DTYPES else 0
    for d in shape:
        n *= d
    return n


class Checkpoint:
    def __init__(self, root: Path, config: K2Config, weight_map: dict[str, str]):
        self.root = root
        self.config = config
        self.weight_map = weight_map  # tensor name as stored -> shard file name
        self.prefix = config.weight_prefix
        weight_formats(config)  # a quantization_config k2trt cannot run is refused before anything is read
        self._shards: dict[str, SafetensorsFile] = {}
        self._globals = {s.name: s for s in global_specs(config)}
        self._layer_specs: dict[str, dict[str, TensorSpec]] = {}  # block kind -> suffix -> spec
        self._header_table: dict[str, HeaderSpec] | None = None  # from the shards' headers, read once (as they are)

    # ---- opening -------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        config = K2Config.from_json(root / "config.json")
        index = root / INDEX_NAME
        if index.exists():
            ckpt = cls(root, config, _read_index(index))
            ckpt._check_shard_files()
            return ckpt
        if (root / SINGLE_NAME).exists():
            single = SafetensorsFile(root / SINGLE_NAME)
            ckpt = cls(root, config, {name: SINGLE_NAME for name in single.names()})
            ckpt._shards[SINGLE_NAME] = single
            return ckpt
        raise CheckpointError(f"{root}: neither {INDEX_NAME} nor {SINGLE_NAME} found")

    def _check_shard_files(self) -> None:
        by_shard: dict[str, list[str]] = {}
        for name, shard in self.weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            regular_file(self.root / shard, CheckpointError, missing=(
                f"{self.root / shard}: shard file missing ({INDEX_NAME} places {len(names)} tensor(s) there, "
                f"e.g. {names[0]})"))

    def shard(self, file_name: str) -> SafetensorsFile:
        f = self._shards.get(file_name)
        if f is None:
            f = self._shards[file_name] = SafetensorsFile(self.root / file_name)
        return f

    def close(self) -> None:
        for f in self._shards.values():
            f.close()
        self._shards.clear()
        self._header_table = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- names -------------------------------------------------------------------------------
    def stored(self, name: str) -> str:
        """The name a text-model tensor has in the files."""
        return self.prefix + name

    def logical(self, stored: str) -> str | None:
        """The text model's name of a stored tensor; None for one outside the text model (K2.5's vision tower)."""
        if not self.prefix:
            return stored
        return stored[len(self.prefix):] if stored.startswith(self.prefix) else None

    # ---- tensors -------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return self.stored(name) in self.weight_map

    def _file_for(self, name: str) -> SafetensorsFile:
        stored = self.stored(name)
        shard = self.weight_map.get(stored)
        if shard is None:
            raise CheckpointError(f"{self.root}: tensor {stored!r} is not in the checkpoint")
        f = self.shard(shard)
        if stored not in f:
            raise CheckpointError(f"{f.path}: tensor {stored!r} is listed in {INDEX_NAME} for this shard "
                                  f"but the shard's header does not have it")
        return f

    def spec(self, name: str) -> TensorSpec | None:
        """The weight table's entry for a full tensor name, or None for a name the config does not use."""
        if name in self._globals:
            return self._globals[name]
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        layer = int(parts[2])
        if layer >= self.config.num_hidden_layers:
            return None
        kind = self.config.layer_kind(layer)
        if kind not in self._layer_specs:  # the specs depend only on the block kind
            self._layer_specs[kind] = {s.name: s for s in layer_specs(self.config, layer)}
        return self._layer_specs[kind].get(parts[3])

    def _checked(self, name: str) -> SafetensorsFile:
        """The file holding `name`, after checking its header entry against the weight table."""
        f = self._file_for(name)
        spec = self.spec(name)
        info = f.info(self.stored(name))
        if spec is not None and (info.shape != spec.shape or not spec.accepts(info.dtype_name)):
            raise CheckpointError(f"{f.path}: tensor {self.stored(name)!r} is {info.dtype_name} {list(info.shape)}, "
                                  f"the config expects {spec.dtype} {list(spec.shape)}")
        return f

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy, memory-mapped; checked against the weight table."""
        return self._checked(name).tensor(self.stored(name))

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy, read without mapping (see SafetensorsFile.read); checked against the weight table."""
        return self._checked(name).read(self.stored(name), out)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The weight table's tensors of layer i, keyed by the suffix after `model.layers.{i}.` (zero-copy)."""
        prefix = layer_prefix(i)
        return {s.name: self.tensor(prefix + s.name) for s in layer_specs(self.config, i)}

    def globals(self, names=None) -> dict[str, torch.Tensor]:
        """The tensors outside the layers (embeddings, final norm, lm_head), zero-copy; only `names` when given
        (a pipeline stage reads only its own files)."""
        return {name: self.tensor(name) for name in (self._globals if names is None else names)}

    def block_weights(self, i: int, experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """The weight inputs of layer i's block graph, in block_weight_specs order, routed experts stacked
        to [E, ...] — only experts [first, stop) when `experts` is given (an expert-parallel rank reads no other
        expert's bytes). Copies, read without mapping (one layer at a time; each expert into its slice of the
        stack)."""
        prefix = layer_prefix(i)
        return assemble_block_weights(self.config, i, lambda suffix, out: self.read(prefix + suffix, out), experts)

    # ---- headers and validation -----------------------------------------------------------------
    def _headers(self) -> dict[str, HeaderSpec]:
        """stored name -> (dtype, shape, shard) for every tensor in every shard, from the headers only (built once
        per opening of the shards: validation, inspect and plan each ask; K2 has 200k tensors)."""
        if self._header_table is None:
            out: dict[str, HeaderSpec] = {}
            for shard in sorted(set(self.weight_map.values())):
                for info in self.shard(shard).infos.values():
                    out[info.name] = HeaderSpec(info.dtype_name, info.shape, shard)
            self._header_table = out
        return self._header_table

    def header_specs(self) -> dict[str, HeaderSpec]:
        """The text model's tensors by their names (graphs/weights.py): (dtype, shape, shard), from the headers."""
        return {name: h for stored, h in self._headers().items() if (name := self.logical(stored)) is not None}

    def other_tensors(self) -> dict[str, HeaderSpec]:
        """The tensors outside the text model, by their stored names (K2.5's vision tower): listed, never loaded."""
        return {stored: h for stored, h in self._headers().items() if self.logical(stored) is None}

    def problems(self, config: K2Config | None = None) -> list[str]:
        """Every difference between the config's tensor table and the index and headers (no data read)."""
        expected: dict[str, TensorSpec] = checkpoint_specs(config or self.config)
        headers = self.header_specs()
        stored = self.stored
        out: list[str] = []
        seen: dict[str, str] = {}
        for shard in sorted(set(self.weight_map.values())):
            for name in self.shard(shard).infos:
                if name in seen:
                    out.append(f"{self.root / shard}: tensor {name!r} is also in {seen[name]}")
                seen[name] = shard
        all_headers = self._headers()
        for name, shard in self.weight_map.items():
            if name not in all_headers or all_headers[name].shard != shard:
                out.append(f"{self.root / shard}: tensor {name!r} is listed in {INDEX_NAME} for this shard "
                           f"but the shard's header does not have it")
        for name, h in all_headers.items():
            if self.weight_map.get(name) != h.shard:
                out.append(f"{self.root / h.shard}: tensor {name!r} is in the shard but {INDEX_NAME} does not place "
                           f"it there")
        for name, h in headers.items():
            where = self.root / h.shard
            spec = expected.get(name)
            if spec is None and self._is_mtp(name, config or self.config):
                continue  # DeepSeek-V3's multi-token-prediction layers: present, and not used for generation
            if spec is None:
                out.append(f"{where}: unexpected tensor {stored(name)!r} (not part of this config's model)")
            elif not spec.accepts(h.dtype):
                out.append(f"{where}: tensor {stored(name)!r} has dtype {h.dtype}, expected {spec.dtype}")
            elif h.shape != spec.shape:
                out.append(f"{where}: tensor {stored(name)!r} has shape {list(h.shape)}, expected {list(spec.shape)}")
            elif spec.kind == SHAPE:
                out += self._shape_problems(name, expected)
        for name in expected:
            if name not in headers and stored(name) not in self.weight_map:  # else reported above
                shard = self.weight_map.get(stored(name))
                where = self.root / shard if shard else self.root
                out.append(f"{where}: missing tensor {stored(name)!r}")
        return out

    def _shape_problems(self, name: str, expected: dict[str, TensorSpec]) -> list[str]:
        """An INT4 weight's weight_shape, read and checked: two positive ints, the (out, in) the config gives."""
        f = self._file_for(name)
        value = [int(v) for v in f.read(self.stored(name)).tolist()]
        packed = expected[name.removesuffix("weight_shape") + "weight_packed"]
        scale = expected[name.removesuffix("weight_shape") + "weight_scale"]
        want = [packed.shape[0], packed.shape[1] * packed.pack]
        where = f"{f.path}: tensor {self.stored(name)!r}"
        if len(value) != 2 or min(value) <= 0:
            return [f"{where} is {value}, not two positive ints"]
        if value != want:
            return [f"{where} is {value}, but the config's weight_packed {list(packed.shape)} and weight_scale "
                    f"{list(scale.shape)} hold {want}"]
        return []

    @staticmethod
    def _is_mtp(name: str, cfg: K2Config) -> bool:
        """A tensor of the num_nextn_predict_layers layers stored after the last decoder layer."""
        if not cfg.num_nextn_predict_layers or not name.startswith("model.layers."):
            return False
        layer = name.split(".")[2]
        return layer.isdigit() and cfg.num_hidden_layers <= int(layer) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers

    def check_tensors(self, names) -> None:
        """Check just these tensors' headers against the weight table (and INT4 weight_shapes' values) before any
        weight is read (a pipeline stage checks its own: it never opens another stage's files)."""
        expected = None
        for name in names:
            self._checked(name)
            if name.endswith(".weight_shape"):
                expected = expected or checkpoint_specs(self.config)
                found = self._shape_problems(name, expected)
                if found:
                    raise CheckpointError(found[0])

    def validate(self, config: K2Config | None = None) -> None:
        """Raise one CheckpointError unless every expected tensor is present with its exact shape and dtype,
        and nothing else is (headers only: no tensor data is read)."""
        found = self.problems(config)
        if found:
            more = f" (and {len(found) - 1} more problem(s))" if len(found) > 1 else ""
            raise CheckpointError(found[0] + more)


def _read_index(path: Path) -> dict[str, str]:
    raw = read_json_object(path, "an HF checkpoint directory needs its index", CheckpointError)
    wm = raw.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{path}: expected an object with a non-empty \"weight_map\"")
    plain = set()  # K2 maps 200k tensors to 62 shards: each distinct name is checked once
    for name, shard in wm.items():
        if isinstance(shard, str) and shard in plain:
            continue
        # Shards are plain file names beside the index: nothing may point outside the directory.
        if member(path.parent, shard, f"{path}: tensor {name!r}", CheckpointError).name != shard:
            raise CheckpointError(f"{path}: tensor {name!r} maps to {shard!r}, which is not a file name beside it")
        plain.add(shard)
    return wm
