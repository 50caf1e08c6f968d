"""`k2trt make-tiny DIR [--format fp8|int4|k2.5]`: a deterministic synthetic checkpoint in exactly the on-disk
format of a Kimi K2 release.

config.json (every K2 field), `model-000NN-of-0000MM.safetensors` shards with an HF index, bf16 norms / embeddings
/ router / lm_head, a float32 router bias, and the tiny Kimi-format tokenizer, with the code files transformers
loads with trust_remote_code (k2trt's own tokenization_kimi.py and configuration_deepseek.py); then, by format:
  fp8   Kimi-K2-Instruct: FP8 e4m3 linears with float32 128x128 block scales;
  int4  Kimi-K2-Thinking: the routed experts compressed-tensors pack-quantized INT4 (group 32, packed by the
        library's own pack_to_int32), every other linear bf16, K2-Thinking's quantization_config; the thinking
        tokenizer (<think> tokens, its chat_template.jinja);
  k2.5  the same weights in Kimi-K2.5's layout: config.json nests the text model in `text_config`, tensors sit
        under `language_model.` beside a (tiny, never loaded) vision tower; K2.5's template opens <think>.
--kv-lora-rank N writes the same tiny at another latent width (K2's 512: vLLM's CPU MLA kernels take only K2's
576 cached values per token, kv_lora_rank 512 + qk_rope_head_dim 64).
The writer (k2trt/checkpoint_writer.py) holds one shard at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Iterator

from k2trt.atomic import atomic_write_text, remove_temporaries, temporary_name
from k2trt.checkpoint_writer import write_checkpoint
from k2trt.dirlock import writer_lock
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.text.tokenizer import NUM_RESERVED_SPECIAL
from k2trt.tiny.synthetic import synthetic_tensors

DEFAULT_SHARDS = 7
# --format -> (config preset, tokenizer flavor)
FORMATS = {"fp8": ("tiny", "k2"), "int4": ("tiny-int4", "thinking"), "k2.5": ("tiny-k2.5", "k2.5")}
# A stand-in for K2.5's vision config: the text model never reads it, inspect lists the tower's tensors.
TINY_VISION_CONFIG = {"model_type": "kimi_k25_vision", "patch_size": 2, "hidden_size": 32, "num_hidden_layers": 1,
                      "mm_hidden_size": 32, "text_hidden_size": 128}


def vision_tensors(cfg: K2Config, seed: int) -> dict:
    """A tiny MoonViT-shaped vision tower and projector (bf16), under the names K2.5 stores them."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    v = TINY_VISION_CONFIG["hidden_size"]
    shapes = {"vision_tower.patch_embed.proj.weight": (v, 3, 2, 2), "vision_tower.encoder.blocks.0.wqkv.weight":
              (3 * v, v), "vision_tower.encoder.blocks.0.wo.weight": (v, v),
              "mm_projector.proj.0.weight": (cfg.hidden_size, 4 * v), "mm_projector.proj.2.weight":
              (cfg.hidden_size, cfg.hidden_size)}
    return {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}


# ---- make-tiny -----------------------------------------------------------------------------------

def with_kv_lora_rank(cfg: K2Config, kv_lora_rank: int) -> K2Config:
    """The config with another latent width (qk_rope_head_dim and the rest unchanged), checked as config.json is
    read: FP8 linears take a whole number of 128-wide activation groups, so an FP8 tiny's kv_lora_rank is a multiple
    of 128."""
    changed = dataclasses.replace(cfg, kv_lora_rank=kv_lora_rank)
    return K2Config.from_hf_dict(changed.to_hf_dict(), f"make-tiny --kv-lora-rank {kv_lora_rank}")


def make_tiny(out_dir: str | Path, seed: int = 0, config: K2Config | None = None, *, force: bool = False,
              n_shards: int = DEFAULT_SHARDS, format: str = "fp8", kv_lora_rank: int | None = None) -> Path:
    """Write the tiny checkpoint (and tokenizer) to out_dir; kv_lora_rank, when given, replaces the config's. It is
    built in a hidden sibling directory and renamed into place at the end, so an interrupted run leaves nothing
    half-written; the parent directory's writer lock keeps two runs apart, and what a killed run left beside out_dir
    is removed first."""
    from k2trt.tiny.tokenizer import write_tiny_tokenizer

    preset, flavor = FORMATS[format]
    cfg = config or K2Config.preset(preset)
    if kv_lora_rank is not None:
        cfg = with_kv_lora_rank(cfg, kv_lora_rank)
    with building(out_dir, "k2trt make-tiny", force) as tmp:
        others = vision_tensors(cfg, seed) if cfg.layout == "k2.5" else None
        write_checkpoint(tmp, cfg, synthetic_tensors(cfg, seed), n_shards, others)
        if others:
            _add_vision_config(tmp / "config.json")
        _write_config_code(tmp, cfg)
        write_tiny_tokenizer(tmp, num_base_tokens=cfg.vocab_size - NUM_RESERVED_SPECIAL, flavor=flavor)
    return Path(out_dir)


@contextlib.contextmanager
def building(out_dir: str | Path, who: str, force: bool) -> Iterator[Path]:
    """The directory to write out_dir's files in: built in a hidden sibling and renamed into place at the end (plain
    permissions), so an interrupted run leaves nothing half-written; the parent directory's writer lock keeps two
    runs apart, and what a killed run left beside out_dir is removed first. An out_dir that is there and not empty
    is replaced only with `force`."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(out.parent, who):
        remove_temporaries(out.parent, target=out.name)
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
            raise K2Error(f"{out}: exists and is not empty (use --force to replace it)")
        tmp = temporary_name(out)
        tmp.mkdir()
        try:
            yield tmp
            _plain_permissions(tmp)
            _replace_dir(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


# config.json's auto_map names the config class K2's releases ship as code (K2Config.to_hf_dict); make-tiny writes
# k2trt's own (this package's module of that name), so transformers' AutoConfig, AutoTokenizer and vLLM load the tiny.
CONFIG_CODE = "configuration_deepseek.DeepseekV3Config"


def _write_config_code(folder: Path, cfg: K2Config) -> None:
    if cfg.to_hf_dict().get("auto_map", {}).get("AutoConfig") == CONFIG_CODE:  # K2.5's layout names none
        name = CONFIG_CODE.split(".")[0] + ".py"
        atomic_write_text(folder / name, (Path(__file__).parent / name).read_text(encoding="utf-8"))


def _add_vision_config(path: Path) -> None:
    import json

    raw = json.loads(path.read_text())
    atomic_write_text(path, json.dumps({**raw, "vision_config": TINY_VISION_CONFIG}, indent=2) + "\n")


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
    old = temporary_name(target, "old")
    os.rename(target, old)
    os.rename(new, target)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "draft", None):
        from k2trt.tiny.draft import make_tiny_draft

        target = K2Config.preset(FORMATS[args.format][0])
        if args.kv_lora_rank is not None:
            target = with_kv_lora_rank(target, args.kv_lora_rank)
        out = make_tiny_draft(args.dir, args.draft, target, seed=args.seed, force=args.force)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"wrote {out}: tiny EAGLE-3 draft ({args.draft}) for the tiny {args.format} target, seed {args.seed}, "
              f"{size / 1e6:.1f} MB")
        return 0
    out = make_tiny(args.dir, seed=args.seed, force=args.force, format=args.format, kv_lora_rank=args.kv_lora_rank)
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    shards = sum(p.suffix == ".safetensors" for p in files)
    latent = "" if args.kv_lora_rank is None else f", kv_lora_rank {args.kv_lora_rank}"
    print(f"wrote {out}: tiny K2 checkpoint ({args.format}{latent}), seed {args.seed}, {shards} shards, "
          f"{len(files)} files, {size / 1e6:.1f} MB")
    return 0
