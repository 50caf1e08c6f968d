"""`python -m k2trt.tools.spec_bench --model DIR --onnx DIR [--speculative-config JSON]`: decode tokens/s with
speculative decoding against without it, in alternated pairs in one run (ratios, not absolute claims), on three
kinds of text:

- `repeats`: greedy continuations long enough to repeat themselves (the tiny model's random weights loop);
- `rejects`: a prompt holding every token of the vocabulary once, so whatever the model writes was seen and a
  draft is found at every step — and the random model does not follow the prompt's order, so drafts are seldom
  kept: what wrong drafts cost under the backoff;
- `novel`: random prompts and seeded continuations that hardly repeat (what a lookup that finds little costs).

Every pair also checks the tokens are the same with and without speculation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from k2trt.args import at_least
from k2trt.errors import K2Error

KINDS = ("repeats", "rejects", "novel")


def _generator(backend, cfg, limits, spec):
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.scheduler import Scheduler

    from k2trt.runtime.generation.eagle import make_drafter

    ex = StageExecutor(backend, cfg)
    drafter = make_drafter(spec, cfg, backend.weights, backend)  # eagle3: the draft, following every sequence
    return Generator(backend, cfg, limits, ex, Scheduler(ex, cfg, limits, speculation=spec, drafter=drafter))


def workload(kind: str, cfg, batch: int, new_tokens: int, seed: int = 0):
    """(prompts, sampling, new tokens) of one kind of text."""
    import random

    from k2trt.runtime.generation.sampling import SamplingParams

    rnd = random.Random(seed)
    if kind == "repeats":
        return [[rnd.randrange(cfg.vocab_size) for _ in range(16)] for _ in range(batch)], SamplingParams(), new_tokens
    if kind == "rejects":
        prompts = []
        for _ in range(batch):
            every = list(range(cfg.vocab_size))
            rnd.shuffle(every)
            prompts.append(every)
        return prompts, SamplingParams(), new_tokens
    return ([[rnd.randrange(cfg.vocab_size) for _ in range(64)] for _ in range(batch)],
            SamplingParams(temperature=1.0, seed=seed), new_tokens)


def measure(model: Path, onnx: Path, spec, kinds, batch: int, new_tokens: int, repeat: int, log=print) -> list[dict]:
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.speculation import SpecCounters

    ckpt = Checkpoint.open(model)
    backend = open_backend(BackendChoice("ort", onnx), ckpt)
    backend.prepare()
    rows = []
    for kind in kinds:
        prompts, params, n = workload(kind, ckpt.config, batch, new_tokens)
        limits = Limits.resolve(ckpt.config, backend.limits, max_context=max(map(len, prompts)) + n + 16,
                                max_batch=batch)
        plain, fast = _generator(backend, ckpt.config, limits, None), _generator(backend, ckpt.config, limits, spec)
        plain.generate(prompts[:1], 4, params)  # warm-up: sessions and capacities
        fast.generate(prompts[:1], 4, params)
        speeds = {"plain": [], "speculative": []}
        same = True
        for _ in range(repeat):
            a, ta = plain.generate(prompts, n, params)
            fast.scheduler.spec_counters = SpecCounters()
            b, tb = fast.generate(prompts, n, params)
            same &= [r.token_ids for r in a] == [r.token_ids for r in b]
            speeds["plain"].append(ta.as_dict()["decode_tokens_per_s"] or 0.0)
            speeds["speculative"].append(tb.as_dict()["decode_tokens_per_s"] or 0.0)
        c = fast.scheduler.spec_counters
        plain_tps, fast_tps = statistics.median(speeds["plain"]), statistics.median(speeds["speculative"])
        rows.append({"kind": kind, "batch": batch, "new_tokens": n, "plain_decode_tokens_per_s": round(plain_tps, 1),
                     "speculative_decode_tokens_per_s": round(fast_tps, 1),
                     "ratio": round(fast_tps / plain_tps, 3) if plain_tps else None,
                     "mean_accepted_length": c.mean_accepted_length and round(c.mean_accepted_length, 2),
                     "drafts": c.num_drafts, "same_tokens": same})
        log(f"spec_bench: {kind}, batch {batch}: {rows[-1]['ratio']}x", file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict]) -> str:
    head = "| text | batch | decode tok/s, plain | with speculation | ratio | tokens per verify step | same tokens |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['batch']} | {r['plain_decode_tokens_per_s']} | "
                     f"{r['speculative_decode_tokens_per_s']} | {r['ratio']}x | {r['mean_accepted_length']} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from k2trt.runtime.entrypoints.model import speculative_config

    p = argparse.ArgumentParser(prog="python -m k2trt.tools.spec_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--onnx", type=Path, required=True)
    p.add_argument("--speculative-config", type=speculative_config,
                   default=speculative_config('{"method": "ngram", "num_speculative_tokens": 4}'))
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {', '.join(KINDS)}")
    p.add_argument("--batch", type=at_least(1), action="append", default=None, help="batch size (repeatable)")
    p.add_argument("--new-tokens", type=at_least(8), default=256)
    p.add_argument("--repeat", type=at_least(1), default=3, help="alternated pairs per row (median)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise K2Error(f"--kinds takes {', '.join(KINDS)}")
    rows = []
    for batch in args.batch or [1, 8]:
        rows += measure(args.model, args.onnx, args.speculative_config, kinds, batch, args.new_tokens, args.repeat)
    print(json.dumps({"rows": rows}) if args.json else render(rows))
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except K2Error as e:
        print(f"spec_bench: error: {e}", file=sys.stderr)
        sys.exit(2)
