"""Prefill memory of long prompts stays bounded by the step, not by the prompt.

`python -m k2trt.tools.prefill_bench --tokens 2048 8192` (`make bench-prefill`) prefills each prompt length in a
fresh child process (the tiny checkpoint through ONNX Runtime unless --model/--onnx say otherwise) and reports the
child's peak RSS growth during the prefill — the high-water mark is reset just before it — against the bound:

    latent cache + (3 x heads + 4) x 4 bytes x mask budget + 16 MiB (SLACK)

where the latent cache is the most the paged cache's pools held at once (it must hold the prompt, and while a pool
grows it holds the old pool beside the new one: PagedLatentCache.peak_bytes).

The scheduler shrinks a prompt's chunks so that a step's mask stays under the budget (runtime/generation/limits.py,
MASK_BUDGET elements); a step's attention holds a few float32 tensors of heads x mask elements (scores,
exponentials, probabilities) and the mask itself. So the working memory of a prefill is the same for 8k tokens
as for 80k; only the cache grows, by what the prompt itself takes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from k2trt.args import at_least
from k2trt.config import K2Config

MB = 1 << 20
SLACK = 16 * MB  # allocator and ONNX Runtime arena rounding

CHILD = textwrap.dedent("""
    import json, sys, time
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.limits import MASK_BUDGET, Limits
    from k2trt.runtime.entrypoints.model import open_model
    from k2trt.runtime.text.tokenizer import NUM_RESERVED_SPECIAL
    from k2trt.tools.stream_bench import proc_status as status

    model, onnx, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckpt, tok = open_model(model)
    backend = open_backend(BackendChoice("ort", onnx=onnx), ckpt)
    backend.prepare()
    limits = Limits.resolve(ckpt.config, backend.limits, mask_budget=budget or MASK_BUDGET)
    gen = Generator(backend, ckpt.config, limits)
    gen.generate([[5] * 64], 1)  # warm-up: sessions and arenas made
    n = int(sys.argv[4])
    prompt = [(i * 7919) % (ckpt.config.vocab_size - NUM_RESERVED_SPECIAL) for i in range(n)]
    chunks, masks = [], [0]
    tensors = gen.executor.tensors
    def counted(plan):  # the largest step mask: what the budget bounds, counted exactly
        st = tensors(plan)
        masks[0] = max(masks[0], st.mask.numel())
        return st
    gen.executor.tensors = counted
    open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark (VmHWM) to the current RSS
    base, t0 = status("VmHWM"), time.perf_counter()
    gen.generate([prompt], 1, on_prefill=lambda r: chunks.append(r.fed))
    print(json.dumps({"budget": gen.limits.mask_budget, "tokens": n, "chunks": len(chunks), "mask": masks[0],
                      "cache": gen.executor.cache.peak_bytes, "growth": status("VmHWM") - base,
                      "seconds": time.perf_counter() - t0}))
""")


def bound(cfg: K2Config, cache: int, mask_budget: int) -> int:
    """cache: the bytes the latent cache held at most (the child measures PagedLatentCache.peak_bytes)."""
    return cache + (3 * cfg.num_attention_heads + 4) * 4 * mask_budget + SLACK


def measure(model: Path, onnx: Path, lengths: list[int], mask_budget: int | None = None) -> list[dict]:
    """Prefill each length in a fresh child process (so no length reuses memory another one grew); per length:
    chunks, the largest step mask (elements), the latent cache's most bytes, peak RSS growth in bytes, seconds, and
    the bound."""
    cfg = K2Config.from_json(model)
    rows = []
    for n in lengths:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(onnx), str(mask_budget or 0), str(n)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"prefill child failed: {proc.stderr.strip().splitlines()[-1]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append({**r, "bound": bound(cfg, r["cache"], r["budget"])})
    return rows


def _tiny(directory: Path) -> tuple[Path, Path]:
    from k2trt.export.exporter import export
    from k2trt.tiny.checkpoint import make_tiny

    model = make_tiny(directory / "tiny")
    export(K2Config.from_json(model), directory / "onnx", "float32", log=lambda *a: None)
    return model, directory / "onnx"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2trt.tools.prefill_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=at_least(1), nargs="+", default=[2048, 8192],
                   help="prompt lengths (default 2048 8192)")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the tiny one, made in a temp dir)")
    p.add_argument("--onnx", type=Path, help="its export directory (float32)")
    p.add_argument("--mask-budget", type=at_least(1), help="mask elements per step (default: the scheduler's)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, onnx = (args.model, args.onnx) if args.model else _tiny(Path(tmp))
        rows = measure(model, onnx, args.tokens, args.mask_budget)
    print(f"{'tokens':>8}{'chunks':>8}{'largest mask':>14}{'cache':>10}{'growth':>10}{'bound':>10}{'seconds':>10}"
          f"  (mask budget {rows[0]['budget']:,} elements)")
    for r in rows:
        print(f"{r['tokens']:>8}{r['chunks']:>8}{r['mask']:>14,}{r['cache'] / MB:>8.0f}MB{r['growth'] / MB:>8.0f}MB"
              f"{r['bound'] / MB:>8.0f}MB{r['seconds']:>10.1f}")
    return 0 if all(r["growth"] <= r["bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
