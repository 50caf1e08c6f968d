"""From command-line choices to a ready checkpoint, tokenizer and backend: the one place that checks that they
belong together. The backend itself comes from the factory (runtime/backends.py)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from k2trt.errors import K2Error
from k2trt.runtime.backend import Backend
from k2trt.runtime.backends import BackendChoice, add_backend_arguments, choice_from_args, open_backend


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (weights, config, tokenizer)")
    add_backend_arguments(p)
    p.add_argument("--max-context", type=int, default=None,
                   help="refuse prompts + new tokens longer than this (default: the model's maximum)")


@dataclass
class Loaded:
    backend: Backend
    tokenizer: object
    checkpoint: object

    @property
    def config(self):
        return self.checkpoint.config


def open_model(model_dir: Path):
    """The checkpoint (every tensor checked against the config, from the headers) and its tokenizer, checked
    against each other: a damaged checkpoint is refused before any weight is bound."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.tokenizer import KimiTokenizer

    ckpt = Checkpoint.open(model_dir)
    ckpt.validate()
    tok = KimiTokenizer.from_dir(model_dir)
    if tok.vocab_size != ckpt.config.vocab_size:
        raise K2Error(f"{model_dir}: tokenizer has {tok.vocab_size} ids but config.json says vocab_size "
                      f"{ckpt.config.vocab_size}")
    return ckpt, tok


def progress_line(prefix: str, doing: str = "binding weights", stream=None):
    """A progress callback show(done, total, what) that rewrites one line on a terminal (and says nothing
    elsewhere): Backend.prepare's, and the long-prefill line of generate."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, what: str) -> None:
        stream.write(f"\r{prefix}: {doing} {done:,}/{total:,} ({what})\033[K" + ("\n" if done == total else ""))
        stream.flush()

    return show


def load(args, choice: BackendChoice | None = None) -> Loaded:
    choice = choice or choice_from_args(args)
    ckpt, tok = open_model(args.model)
    backend = open_backend(choice, ckpt)
    backend.prepare(progress=progress_line(f"k2trt {getattr(args, 'command', 'generate')}"))
    return Loaded(backend, tok, ckpt)


def make_generator(loaded: Loaded, max_context: int | None):
    from k2trt.runtime.generator import Generator

    return Generator(loaded.backend, loaded.config, stop_ids=tuple(loaded.tokenizer.stop_ids), max_context=max_context)
