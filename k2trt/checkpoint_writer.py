"""Writing a checkpoint directory in K2's on-disk format from a stream of tensors: config.json, sharded
`model-000NN-of-0000MM.safetensors` files and the HF index. Holds one shard in memory at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import torch

from k2trt.atomic import atomic_write_text
from k2trt.checkpoint import INDEX_NAME
from k2trt.config import K2Config
from k2trt.dtypes import torch_dtype
from k2trt.graphs.weights import PARAM, TensorSpec, global_specs, layer_prefix, layer_specs
from k2trt.safetensors_io import save_file

def shard_name(i: int, n: int) -> str:
    """K2's naming: model-00001-of-000062.safetensors."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def ordered_specs(cfg: K2Config) -> list[TensorSpec]:
    """Every tensor in file order, with full names: embeddings, the layers, final norm, lm_head (K2's shards put
    the norm and the head last)."""
    embed, norm, head = global_specs(cfg)
    specs = [embed]
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        specs += [s.renamed(p + s.name) for s in layer_specs(cfg, layer)]
    return specs + [norm, head]


def shard_plan(specs: list[TensorSpec], n_shards: int) -> list[list[TensorSpec]]:
    """Split the tensors into about n_shards of similar size. Each cut falls between a quantized weight and its
    scale, so (as in K2's own shards) a weight and its weight_scale_inv (or weight_scale) can sit in different
    files."""
    target = math.ceil(sum(s.nbytes for s in specs) / n_shards)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for i, spec in enumerate(specs):
        shards[-1].append(spec)
        size += spec.nbytes
        next_is_scale = i + 1 < len(specs) and specs[i + 1].is_scale
        if size >= target and spec.kind == PARAM and next_is_scale:
            shards.append([])
            size = 0
    return [s for s in shards if s]


def write_checkpoint(out_dir: str | Path, cfg: K2Config, tensors: Iterable[tuple[str, torch.Tensor]],
                     n_shards: int, others: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Write config.json, the shards and the index into out_dir from a stream of (name, tensor) in
    ordered_specs order, each stored under the layout's prefix (K2Config.weight_prefix). `others` (stored names:
    K2.5's vision tower) go into a last shard of their own. Returns the shard file names."""
    out_dir = Path(out_dir)
    plan = shard_plan(ordered_specs(cfg), n_shards)
    n_files = len(plan) + bool(others)
    names = [shard_name(i + 1, n_files) for i in range(n_files)]
    prefix = cfg.weight_prefix
    stream = iter(tensors)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, specs in zip(names, plan):
        shard: dict[str, torch.Tensor] = {}
        for spec in specs:
            name, t = next(stream, (None, None))
            if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != torch_dtype(spec.dtype):
                got = "end of stream" if name is None else f"{name} {t.dtype} {list(t.shape)}"
                raise ValueError(f"tensor stream out of step: expected {spec.name} {spec.dtype} "
                                 f"{list(spec.shape)}, got {got}")
            shard[prefix + name] = t.contiguous()
            weight_map[prefix + name] = file_name
            total += spec.nbytes
        save_file(shard, out_dir / file_name)
        del shard
    if next(stream, None) is not None:
        raise ValueError("tensor stream has more tensors than the config")
    if others:
        save_file({k: v.contiguous() for k, v in others.items()}, out_dir / names[-1])
        weight_map.update({k: names[-1] for k in others})
        total += sum(v.numel() * v.element_size() for v in others.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    cfg.write_json(out_dir / "config.json")
    return names
