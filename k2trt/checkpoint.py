"""A K2 checkpoint directory: config.json plus safetensors shards (an HF index, or one model.safetensors).

Tensors are read lazily: a shard's header is parsed the first time one of its tensors (or the header
itself) is needed, and its data is memory-mapped only when a tensor is asked for. `block_weights` instead
copies one layer with plain reads, so streaming all 61 layers keeps only one layer resident.

Every tensor handed out — by `tensor`, `layer`, `globals` or `block_weights` — is first checked against the
weight table (graphs/weights.py): a tensor the config names must have exactly its shape and dtype, so nothing
downstream (ONNX Runtime, TensorRT, the reference) ever sees a tensor that `validate` would refuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from k2trt.config import K2Config
from k2trt.files import member, read_json_object, regular_file
from k2trt.graphs.weights import (TensorSpec, assemble_block_weights, checkpoint_specs, global_specs, layer_prefix,
                                  layer_specs)
from k2trt.safetensors_io import CheckpointError, SafetensorsFile

__all__ = ["Checkpoint", "CheckpointError", "HeaderSpec", "INDEX_NAME", "SINGLE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class HeaderSpec(NamedTuple):
    dtype: str  # torch dtype name, as in graphs/weights.py ("float8_e4m3fn", "bfloat16", "float32", ...)
    shape: tuple[int, ...]
    shard: str  # file name inside the checkpoint directory


class Checkpoint:
    def __init__(self, root: Path, config: K2Config, weight_map: dict[str, str]):
        self.root = root
        self.config = config
        self.weight_map = weight_map  # tensor name -> shard file name
        self._shards: dict[str, SafetensorsFile] = {}
        self._globals = {s.name: s for s in global_specs(config)}
        self._layer_specs: dict[str, dict[str, TensorSpec]] = {}  # block kind -> suffix -> spec

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

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- tensors -------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file_for(self, name: str) -> SafetensorsFile:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.root}: tensor {name!r} is not in the checkpoint")
        f = self.shard(shard)
        if name not in f:
            raise CheckpointError(f"{f.path}: tensor {name!r} is listed in {INDEX_NAME} for this shard "
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
        info = f.info(name)
        if spec is not None and (info.shape != spec.shape or info.dtype_name != spec.dtype):
            raise CheckpointError(f"{f.path}: tensor {name!r} is {info.dtype_name} {list(info.shape)}, the config "
                                  f"expects {spec.dtype} {list(spec.shape)}")
        return f

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy, memory-mapped; checked against the weight table."""
        return self._checked(name).tensor(name)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy, read without mapping (see SafetensorsFile.read); checked against the weight table."""
        return self._checked(name).read(name, out)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The weight table's tensors of layer i, keyed by the suffix after `model.layers.{i}.` (zero-copy)."""
        prefix = layer_prefix(i)
        return {s.name: self.tensor(prefix + s.name) for s in layer_specs(self.config, i)}

    def globals(self, names=None) -> dict[str, torch.Tensor]:
        """The tensors outside the layers (embeddings, final norm, lm_head), zero-copy; only `names` when given
        (a pipeline stage reads only its own files)."""
        return {name: self.tensor(name) for name in (self._globals if names is None else names)}

    def block_weights(self, i: int) -> dict[str, torch.Tensor]:
        """The weight inputs of layer i's block graph, in block_weight_specs order, routed experts stacked
        to [E, ...]. Copies, read without mapping (one layer at a time; each expert into its slice of the stack)."""
        prefix = layer_prefix(i)
        return assemble_block_weights(self.config, i, lambda suffix, out: self.read(prefix + suffix, out))

    # ---- headers and validation -----------------------------------------------------------------
    def header_specs(self) -> dict[str, HeaderSpec]:
        """name -> (dtype, shape, shard) for every tensor in every shard, from the headers only."""
        out: dict[str, HeaderSpec] = {}
        for shard in sorted(set(self.weight_map.values())):
            for info in self.shard(shard).infos.values():
                out[info.name] = HeaderSpec(info.dtype_name, info.shape, shard)
        return out

    def problems(self, config: K2Config | None = None) -> list[str]:
        """Every difference between the config's tensor table and the index and headers (no data read)."""
        expected: dict[str, TensorSpec] = checkpoint_specs(config or self.config)
        headers = self.header_specs()
        out: list[str] = []
        seen: dict[str, str] = {}
        for shard in sorted(set(self.weight_map.values())):
            for name in self.shard(shard).infos:
                if name in seen:
                    out.append(f"{self.root / shard}: tensor {name!r} is also in {seen[name]}")
                seen[name] = shard
        for name, shard in self.weight_map.items():
            if name not in headers or headers[name].shard != shard:
                out.append(f"{self.root / shard}: tensor {name!r} is listed in {INDEX_NAME} for this shard "
                           f"but the shard's header does not have it")
        for name, h in headers.items():
            where = self.root / h.shard
            if self.weight_map.get(name) != h.shard:
                out.append(f"{where}: tensor {name!r} is in the shard but {INDEX_NAME} does not place it there")
            spec = expected.get(name)
            if spec is None and self._is_mtp(name, config or self.config):
                continue  # DeepSeek-V3's multi-token-prediction layers: present, and not used for generation
            if spec is None:
                out.append(f"{where}: unexpected tensor {name!r} (not part of this config's model)")
            elif h.dtype != spec.dtype:
                out.append(f"{where}: tensor {name!r} has dtype {h.dtype}, expected {spec.dtype}")
            elif h.shape != spec.shape:
                out.append(f"{where}: tensor {name!r} has shape {list(h.shape)}, expected {list(spec.shape)}")
        for name in expected:
            if name not in headers and name not in self.weight_map:  # else reported above
                shard = self.weight_map.get(name)
                where = self.root / shard if shard else self.root
                out.append(f"{where}: missing tensor {name!r}")
        return out

    @staticmethod
    def _is_mtp(name: str, cfg: K2Config) -> bool:
        """A tensor of the num_nextn_predict_layers layers stored after the last decoder layer."""
        if not cfg.num_nextn_predict_layers or not name.startswith("model.layers."):
            return False
        layer = name.split(".")[2]
        return layer.isdigit() and cfg.num_hidden_layers <= int(layer) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers

    def check_tensors(self, names) -> None:
        """Check just these tensors' headers against the weight table before any is read (a pipeline stage checks
        its own: it never opens another stage's files)."""
        for name in names:
            self._checked(name)

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
    for name, shard in wm.items():
        # Shards are plain file names beside the index: nothing may point outside the directory.
        if member(path.parent, shard, f"{path}: tensor {name!r}", CheckpointError).name != shard:
            raise CheckpointError(f"{path}: tensor {name!r} maps to {shard!r}, which is not a file name beside it")
    return wm
