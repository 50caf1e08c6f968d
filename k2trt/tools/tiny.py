"""`k2trt make-tiny DIR`: a deterministic synthetic checkpoint in exactly K2's on-disk format.

config.json (every K2 field), `model-000NN-of-0000MM.safetensors` shards with an HF index, FP8 e4m3 linears
with float32 128x128 block scales, bf16 norms / embeddings / router / lm_head, a float32 router bias, and
the tiny Kimi-format tokenizer. The writer (k2trt/checkpoint_writer.py) holds one shard at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from k2trt.args import seed
from k2trt.atomic import remove_temporaries, temporary_name
from k2trt.checkpoint_writer import write_checkpoint
from k2trt.dirlock import writer_lock
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.text.tokenizer import NUM_RESERVED_SPECIAL
from k2trt.tools.synthetic import synthetic_tensors

DEFAULT_SHARDS = 7


# ---- make-tiny -----------------------------------------------------------------------------------

def make_tiny(out_dir: str | Path, seed: int = 0, config: K2Config | None = None, *, force: bool = False,
              n_shards: int = DEFAULT_SHARDS) -> Path:
    """Write the tiny checkpoint (and tokenizer) to out_dir. It is built in a hidden sibling directory
    and renamed into place at the end, so an interrupted run leaves nothing half-written; the parent directory's
    writer lock keeps two runs apart, and what a killed run left beside out_dir is removed first."""
    from k2trt.tools.tiny_tokenizer import write_tiny_tokenizer

    cfg = config or K2Config.preset("tiny")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(out.parent, "k2trt make-tiny"):
        remove_temporaries(out.parent, target=out.name)
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
            raise K2Error(f"{out}: exists and is not empty (use --force to replace it)")
        tmp = temporary_name(out)
        tmp.mkdir()
        try:
            write_checkpoint(tmp, cfg, synthetic_tensors(cfg, seed), n_shards)
            write_tiny_tokenizer(tmp, num_base_tokens=cfg.vocab_size - NUM_RESERVED_SPECIAL)
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
    old = temporary_name(target, "old")
    os.rename(target, old)
    os.rename(new, target)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")


def run(args: argparse.Namespace) -> int:
    out = make_tiny(args.dir, seed=args.seed, force=args.force)
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    shards = sum(p.suffix == ".safetensors" for p in files)
    print(f"wrote {out}: tiny K2 checkpoint, seed {args.seed}, {shards} shards, {len(files)} files, "
          f"{size / 1e6:.1f} MB")
    return 0
