"""The `k2trt chat` command: its arguments, and the call into k2trt.runtime.entrypoints.chat."""

from __future__ import annotations

from k2trt.runtime.entrypoints.sampling_args import add_sampling_arguments
from k2trt.runtime.entrypoints.model import add_model_arguments
from k2trt.runtime.entrypoints import chat


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--system", default=None, help="system prompt (default: the template's)")
    add_sampling_arguments(p)


def run(args) -> int:
    return chat.run(args)
