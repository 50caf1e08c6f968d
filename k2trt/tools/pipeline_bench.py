"""`k2trt bench --pipeline N`: the per-step time of pipeline stages, and the share of it spent moving messages,
in the same run as a single process on the same prompts (the first --batch and --prompt-len).

The user's process measures the single process first, then starts the N ranks (runtime/distributed/launch.py) with
that row in their environment; rank 0 measures the pipeline, gathers every rank's counters when it ends the
pipeline (runtime/distributed/session.RankStats), and prints both rows. The transfer share is rank 0's time in
sends, receives and broadcasts less what the other ranks were busy with meanwhile, over its step time.
"""

from __future__ import annotations

import json
import os

from k2trt.runtime.backends.factory import BackendChoice
from k2trt.tools.synthetic import synthetic_prompts

SINGLE_ENV = "K2TRT_BENCH_SINGLE"  # the single-process row, handed to the ranks


def measure(gen, prompts, new_tokens: int, repeat: int) -> dict:
    gen.generate(prompts, 2)  # warm-up
    best = None
    for _ in range(repeat):
        _, t = gen.generate(prompts, new_tokens)
        if best is None or t.prefill_s + t.decode_s < best.prefill_s + best.decode_s:
            best = t
    d = best.as_dict()
    d["ms_per_decode_step"] = round(1000 * best.decode_s / max(1, best.decode_steps), 3)
    return d


def single_process(args) -> dict:
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.commands.model import load_model

    loaded = load_model(args, BackendChoice("ort", args.onnx), command="bench")
    gen = Generator(loaded.backend, loaded.config)
    return measure(gen, prompts_of(args, loaded.config), args.new_tokens, args.repeat)


def prompts_of(args, cfg) -> list[list[int]]:
    return synthetic_prompts(cfg, args.batch[0], args.prompt_len[0])


def render(single: dict | None, piped: dict, stages: int, share: float) -> str:
    head = f"{'':<22}{'ms/decode step':>16}{'prefill tok/s':>15}{'decode tok/s':>14}{'transfer share':>16}"
    rows = [head]
    if single:
        rows.append(f"{'single process':<22}{single['ms_per_decode_step']:>16}{single['prefill_tokens_per_s']:>15}"
                    f"{single['decode_tokens_per_s']:>14}{'-':>16}")
    label = f"pipeline, {stages} stages"
    rows.append(f"{label:<22}{piped['ms_per_decode_step']:>16}{piped['prefill_tokens_per_s']:>15}"
                f"{piped['decode_tokens_per_s']:>14}{share:>15.1%}")
    if single and single["ms_per_decode_step"]:
        ratio = piped["ms_per_decode_step"] / single["ms_per_decode_step"]
        rows.append(f"a decode step through {stages} stages takes {ratio:.2f}x the single process's")
    return "\n".join(rows)


def run(args) -> int:
    from k2trt.runtime.distributed.launch import run_pipeline
    from k2trt.runtime.distributed.session import transfer_share
    from k2trt.runtime.distributed.world import launched
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.commands.model import load_model

    if not launched():
        os.environ[SINGLE_ENV] = json.dumps(single_process(args))
        return run_pipeline(args.argv, args.pipeline)
    loaded = load_model(args, BackendChoice("ort", args.onnx), command="bench")
    if loaded.follower:
        loaded.session.follow()
        return 0
    gen = Generator(loaded.backend, loaded.config, executor=loaded.executor)
    piped = measure(gen, prompts_of(args, loaded.config), args.new_tokens, args.repeat)
    stats = loaded.close()
    share = transfer_share(stats)
    single = json.loads(os.environ.get(SINGLE_ENV) or "null")
    if args.json:
        print(json.dumps({"single_process": single, "pipeline": {**piped, "stages": len(stats),
                                                                   "transfer_share": round(share, 4)}}))
    else:
        print(render(single, piped, len(stats), share))
    return 0
