"""`k2trt bench`: prefill and decode tokens/s of the runtime (ONNX Runtime over the exported graphs) and of the
eager torch reference, on the same prompts in the same run, their ratio, and the per-step host time spent
outside the backend's sessions. Speed is reported as ratios against the reference, not as absolute claims."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k2trt.errors import K2Error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--onnx", type=Path, required=True)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per backend (best is reported)")
    p.add_argument("--json", action="store_true")


def _measure(backend, cfg, prompts, new_tokens, repeat):
    from k2trt.runtime.generator import Generator

    backend.prepare()  # every layer's weights bound, so loading is not timed
    gen = Generator(backend, cfg)
    gen.generate(prompts, 2)  # warm-up
    best = None
    for _ in range(repeat):
        _, t = gen.generate(prompts, new_tokens)
        if best is None or t.prefill_s + t.decode_s < best.prefill_s + best.decode_s:
            best = t
    return best


def run(args) -> int:
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends import BackendChoice, open_backend

    if args.prompt_len < 1 or args.new_tokens < 2 or args.batch < 1 or args.repeat < 1:
        raise K2Error("--prompt-len, --batch, --repeat must be >= 1 and --new-tokens >= 2")
    ckpt = Checkpoint.open(args.model)
    cfg = ckpt.config
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size - 256, (args.batch, args.prompt_len), generator=g).tolist()
    rows = []
    for name, choice in (("torch reference", BackendChoice("torch")), ("onnxruntime", BackendChoice("ort", args.onnx))):
        print(f"benchmarking {name} (batch {args.batch}, prompt {args.prompt_len}, new {args.new_tokens}) ...",
              flush=True)
        t0 = time.perf_counter()
        timings = _measure(open_backend(choice, ckpt), cfg, prompts, args.new_tokens, args.repeat)
        d = timings.as_dict()
        steps = timings.decode_steps + 1
        d["host_ms_per_step"] = round(1000 * timings.host_s / steps, 3)
        d["host_share"] = round(timings.host_s / (timings.prefill_s + timings.decode_s), 4)
        d["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append((name, d))
    ref, rt = rows[0][1], rows[1][1]
    ratio = {k: round(rt[k] / ref[k], 2) for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    if args.json:
        print(json.dumps({"rows": dict(rows), "ratio_runtime_over_reference": ratio}))
        return 0
    print()
    print(f"{'backend':<18}{'prefill tok/s':>15}{'decode tok/s':>15}{'host ms/step':>15}{'host share':>12}")
    for name, d in rows:
        print(f"{name:<18}{d['prefill_tokens_per_s']:>15}{d['decode_tokens_per_s']:>15}"
              f"{d['host_ms_per_step']:>15}{d['host_share']:>12.1%}")
    print(f"{'ratio runtime/ref':<18}{ratio['prefill_tokens_per_s']:>14}x{ratio['decode_tokens_per_s']:>14}x")
    print("host = step time outside ONNX Runtime's run calls (onnxruntime) or outside the block calls (torch); "
          "weights are bound before timing")
    return 0
