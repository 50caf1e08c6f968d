"""`k2trt make-tiny DIR`: a deterministic synthetic checkpoint in exactly K2's on-disk format.

config.json (every K2 field), `model-000NN-of-0000MM.safetensors` shards with an HF index, FP8 e4m3 linears
with float32 128x128 block scales, bf16 norms / embeddings / router / lm_head, a float32 router bias, and
the tiny Kimi-format tokenizer. The writer streams tensor by tensor, so it holds one shard at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.weights import (
    FP8,
    TensorSpec,
    global_specs,
    layer_prefix,
    layer_specs,
)
from k2trt.graphs.init import RandomWeights
from k2trt.safetensors_io import save_file

DEFAULT_SHARDS = 7


def shard_name(i: int, n: int) -> str:
    """K2's naming: model-00001-of-000062.safetensors."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def ordered_specs(cfg: K2Config) -> list[TensorSpec]:
    """Every tensor in file order: embeddings, the layers, final norm, lm_head (full names)."""
    embed, norm, head = global_specs(cfg)
    specs = [embed]
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        specs += [TensorSpec(p + s.name, s.shape, s.dtype) for s in layer_specs(cfg, layer)]
    return specs + [norm, head]


def spec_bytes(spec: TensorSpec) -> int:
    return spec.numel * getattr(torch, spec.dtype).itemsize


def shard_plan(specs: list[TensorSpec], n_shards: int) -> list[list[TensorSpec]]:
    """Split the tensors into about n_shards of similar size. Each cut falls between an FP8 weight and its
    scale, so (as in K2's own shards) a weight and its weight_scale_inv can sit in different files."""
    target = math.ceil(sum(spec_bytes(s) for s in specs) / n_shards)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for i, spec in enumerate(specs):
        shards[-1].append(spec)
        size += spec_bytes(spec)
        next_is_scale = i + 1 < len(specs) and specs[i + 1].is_scale
        if size >= target and spec.dtype == FP8 and next_is_scale:
            shards.append([])
            size = 0
    return [s for s in shards if s]


def write_checkpoint(out_dir: str | Path, cfg: K2Config, tensors: Iterable[tuple[str, torch.Tensor]],
                     n_shards: int = DEFAULT_SHARDS) -> list[str]:
    """Write config.json, the shards and model.safetensors.index.json into out_dir from a stream of
    (name, tensor) in ordered_specs order; holds one shard in memory. Returns the shard file names."""
    out_dir = Path(out_dir)
    plan = shard_plan(ordered_specs(cfg), n_shards)
    names = [shard_name(i + 1, len(plan)) for i in range(len(plan))]
    stream = iter(tensors)
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, specs in zip(names, plan):
        shard: dict[str, torch.Tensor] = {}
        for spec in specs:
            name, t = next(stream, (None, None))
            if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != getattr(torch, spec.dtype):
                got = "end of stream" if name is None else f"{name} {t.dtype} {list(t.shape)}"
                raise ValueError(f"tensor stream out of step: expected {spec.name} {spec.dtype} "
                                 f"{list(spec.shape)}, got {got}")
            shard[name] = t.contiguous()
            weight_map[name] = file_name
            total += spec_bytes(spec)
        save_file(shard, out_dir / file_name)
        del shard
    if next(stream, None) is not None:
        raise ValueError("tensor stream has more tensors than the config")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg.write_json(out_dir / "config.json")
    return names


# ---- synthetic weights ---------------------------------------------------------------------------

def synthetic_tensors(cfg: K2Config, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic random weights in ordered_specs order (one layer generated at a time)."""
    weights = RandomWeights(cfg, seed)
    g = weights.globals()
    embed, norm, head = global_specs(cfg)
    yield embed.name, g[embed.name]
    for layer in range(cfg.num_hidden_layers):
        p = layer_prefix(layer)
        for name, tensor in weights.layer(layer).items():
            yield p + name, tensor
    yield norm.name, g[norm.name]
    yield head.name, g[head.name]


# ---- make-tiny -----------------------------------------------------------------------------------

def make_tiny(out_dir: str | Path, seed: int = 0, config: K2Config | None = None, *, force: bool = False,
              n_shards: int = DEFAULT_SHARDS) -> Path:
    """Write the tiny checkpoint (and tokenizer) to out_dir. It is built in a hidden sibling directory
    and renamed into place at the end, so an interrupted run leaves nothing half-written."""
    from k2trt.tiny_tokenizer import write_tiny_tokenizer

    cfg = config or K2Config.preset("tiny")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise K2Error(f"{out}: exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        write_checkpoint(tmp, cfg, synthetic_tensors(cfg, seed), n_shards)
        write_tiny_tokenizer(tmp, num_base_tokens=cfg.vocab_size - 256)
        _plain_permissions(tmp)
        _replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _plain_permissions(folder: Path) -> None:
    """Temporary-file writers create 0600 files; a checkpoint should be as readable as any file."""
    mask = os.umask(0)
    os.umask(mask)
    for p in folder.iterdir():
        p.chmod(0o666 & ~mask)


def _replace_dir(new: Path, target: Path) -> None:
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.rename(new, target)
        return
    # --force: move the old one aside first, so a crash leaves either the old or the new in place.
    old = target.parent / f".{target.name}.{secrets.token_hex(4)}.old"
    os.rename(target, old)
    os.rename(new, target)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")


def run(args: argparse.Namespace) -> int:
    out = make_tiny(args.dir, seed=args.seed, force=args.force)
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    shards = sum(p.suffix == ".safetensors" for p in files)
    print(f"wrote {out}: tiny K2 checkpoint, seed {args.seed}, {shards} shards, {len(files)} files, "
          f"{size / 1e6:.1f} MB")
    return 0
