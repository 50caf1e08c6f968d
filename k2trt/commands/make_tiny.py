"""The `k2trt make-tiny` command: its arguments, and the call into k2trt.tiny.checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from k2trt.args import at_least, seed
from k2trt.tiny import checkpoint
from k2trt.tiny.checkpoint import FORMATS
from k2trt.tiny.draft import DRAFT_FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    parser.add_argument("--format", choices=list(FORMATS), default="fp8",
                        help="fp8: Kimi-K2-Instruct (default); int4: Kimi-K2-Thinking (INT4 experts); "
                             "k2.5: the INT4 model in Kimi-K2.5's layout")
    parser.add_argument("--kv-lora-rank", type=at_least(1), default=None, metavar="N",
                        help="the attention's latent width (default: the tiny's, 128); 512 is K2's, which vLLM's "
                             "CPU MLA kernels require (a multiple of 128 in FP8)")
    parser.add_argument("--draft", choices=list(DRAFT_FORMATS), default=None,
                        help="write instead an EAGLE-3 draft for that tiny target, as published: llama "
                             "(LlamaForCausalLMEagle3, AQ-MedAI's layout), mla (Eagle3DeepseekV2ForCausalLM), "
                             "speculators (vLLM's speculators format)")


def run(args) -> int:
    return checkpoint.run(args)
