"""The sampling and stop arguments generate and chat share, each checked by the sampling field's own rule
(runtime/generation/sampling.py), and what they become: SamplingParams and a request's StopRules."""

from __future__ import annotations

import argparse

from k2trt.args import at_least, checked, integer
from k2trt.runtime.generation.sampling import DEFAULTS, SamplingParams, field_problem
from k2trt.runtime.text.text_stream import StopRules


def _sampling_value(name: str, parse, kind: str):
    """An argparse type checked by the sampling field's own rule (runtime/generation/sampling.py)."""
    return checked(parse, lambda value: field_problem(name, value), kind)



def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--temperature", type=_sampling_value("temperature", float, "a number"),
                   default=DEFAULTS.temperature, help=f"0 = greedy (default {DEFAULTS.temperature:g})")
    p.add_argument("--top-k", type=_sampling_value("top_k", integer, "an integer"), default=DEFAULTS.top_k,
                   help=f"0 = off (default {DEFAULTS.top_k})")
    p.add_argument("--top-p", type=_sampling_value("top_p", float, "a number"), default=DEFAULTS.top_p,
                   help=f"1 = off (default {DEFAULTS.top_p:g})")
    p.add_argument("--seed", type=_sampling_value("seed", integer, "an integer"), default=DEFAULTS.seed,
                   help=f"(default {DEFAULTS.seed})")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=at_least(0), default=[], metavar="ID",
                   help="also stop at this token id (repeatable), besides [EOS] and <|im_end|>")
    p.add_argument("--hide-thinking", action="store_true",
                   help="do not show a thinking template's reasoning (it is shown dimmed)")



def to_sampling_params(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)



def stop_rules(tok, args) -> StopRules:
    """The model's stop tokens, --stop-token-id and --stop: what ends a sequence and what is never shown."""
    return StopRules.of(tok, strings=args.stop, stop_ids=args.stop_token_id)
