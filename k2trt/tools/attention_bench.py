"""`python -m k2trt.tools.attention_bench`: where MLA's decompressed form overtakes the absorbed one on this CPU.

Both forms of graphs/blocks.attention (attend_absorbed, attend_decompressed) are recorded alone as ONNX graphs,
exactly as the block graphs record them, and run on ONNX Runtime (the CPU backend) in float32 over one sequence
with T new positions and P past ones, in alternated pairs. The table gives each form's median milliseconds and the
ratio decompressed / absorbed, and, per P, the fewest T from which the decompressed form is faster — beside the
switch the graphs use (blocks.decompress_from: where its keys and values take no more memory than its scores,
past its multiply-add break-even). The crossing does not depend on the number of heads
(both forms are per head), so --heads can be small to keep K2's widths quick to time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import numpy as np

from k2trt.args import at_least
from k2trt.config import PRESETS, K2Config
from k2trt.errors import K2Error

FORMS = ("absorbed", "decompressed")
INPUTS = ("q_nope", "q_pe", "latent_cache", "latent_new", "attention_mask", "wkv")


def form_graph(cfg: K2Config, form: str):
    """One attention form as an ONNX model over INPUTS (float32), recorded from graphs/blocks.py."""
    from k2trt.export.block_graphs import IR_VERSION, OPSET
    from k2trt.export.onnx_ops import OnnxOps
    from k2trt.graphs import blocks

    ops = OnnxOps("float32", OPSET)
    ins = [ops.input(name, "float32", shape) for name, shape in zip(INPUTS, (
        ["B", cfg.num_attention_heads, "T", cfg.qk_nope_head_dim], ["B", cfg.num_attention_heads, "T", cfg.qk_rope_head_dim],
        ["B", "P", cfg.latent_dim], ["B", "T", cfg.latent_dim], ["B", "T", "P+T"],
        [cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank]))]
    out = getattr(blocks, f"attend_{form}")(ops, cfg, *ins)
    ops.output(out, "o", ["B", cfg.num_attention_heads, "T", cfg.v_head_dim])
    return ops.model(f"attend_{form}", IR_VERSION)


def feeds(cfg: K2Config, t: int, p: int, seed: int = 0) -> dict:
    from k2trt.graphs.mask import simple_mask

    rnd = np.random.default_rng(seed)
    h = cfg.num_attention_heads
    f = {"q_nope": rnd.standard_normal((1, h, t, cfg.qk_nope_head_dim)),
         "q_pe": rnd.standard_normal((1, h, t, cfg.qk_rope_head_dim)),
         "latent_cache": rnd.standard_normal((1, p, cfg.latent_dim)),
         "latent_new": rnd.standard_normal((1, t, cfg.latent_dim)),
         "wkv": rnd.standard_normal((h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank))
         / cfg.kv_lora_rank ** 0.5}
    f = {k: v.astype(np.float32) for k, v in f.items()}
    f["attention_mask"] = simple_mask(1, p, t).numpy()
    return f


def measure(cfg: K2Config, tokens: list[int], pasts: list[int], repeat: int, threads: int | None,
            log=print) -> list[dict]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    sessions = {f: ort.InferenceSession(form_graph(cfg, f).SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"]) for f in FORMS}
    rows = []
    for p in pasts:
        for t in tokens:
            f = feeds(cfg, t, p)
            times = {form: [] for form in FORMS}
            outs = {form: s.run(None, f)[0] for form, s in sessions.items()}  # warm-up, and the forms agree
            scale = float(np.abs(outs["absorbed"]).max()) or 1.0
            err = float(np.abs(outs["absorbed"] - outs["decompressed"]).max()) / scale
            for i in range(repeat):
                for form in (FORMS if i % 2 == 0 else FORMS[::-1]):  # alternated: drift hits both alike
                    t0 = time.perf_counter()
                    sessions[form].run(None, f)
                    times[form].append(time.perf_counter() - t0)
            ms = {form: 1e3 * statistics.median(v) for form, v in times.items()}
            rows.append({"past": p, "new": t, "absorbed_ms": ms["absorbed"], "decompressed_ms": ms["decompressed"],
                         "ratio": ms["decompressed"] / ms["absorbed"], "rel_err": err})
            log(f"  P {p:>6}  T {t:>5}: absorbed {ms['absorbed']:9.2f} ms  decompressed {ms['decompressed']:9.2f} ms")
    return rows


def crossings(rows: list[dict]) -> dict[int, int | None]:
    """Per past P: the fewest T measured from which the decompressed form is faster at every larger T measured."""
    out = {}
    for p in sorted({r["past"] for r in rows}):
        at = sorted((r for r in rows if r["past"] == p), key=lambda r: r["new"])
        out[p] = None
        for i, r in enumerate(at):
            if all(s["ratio"] <= 1.0 for s in at[i:]):
                out[p] = r["new"]
                break
    return out


def table(cfg_name: str, cfg: K2Config, rows: list[dict]) -> str:
    from k2trt.graphs import blocks

    lines = [f"MLA attention forms on ONNX Runtime, float32, {cfg_name} widths (latent {cfg.kv_lora_rank} + "
             f"{cfg.qk_rope_head_dim}, nope {cfg.qk_nope_head_dim}, v {cfg.v_head_dim}), {cfg.num_attention_heads} heads",
             "", "| past P | new T | absorbed ms | decompressed ms | decompressed / absorbed |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['past']} | {r['new']} | {r['absorbed_ms']:.2f} | {r['decompressed_ms']:.2f} | {r['ratio']:.2f} |"
              for r in rows]
    lines.append("")
    for p, t in crossings(rows).items():
        lines.append(f"P {p}: decompressed faster from T = {t if t is not None else '(none measured)'}")
    lines.append(f"the graphs switch at T = {blocks.decompress_from(cfg)} (blocks.decompress_from)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k2trt.tools.attention_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="kimi-k2", choices=sorted(PRESETS), help="whose widths (default kimi-k2)")
    ap.add_argument("--heads", type=at_least(1), default=8, help="heads timed (default 8; the crossing is per head)")
    ap.add_argument("--tokens", type=at_least(1), nargs="+", default=[1, 16, 64, 96, 128, 160, 192, 256, 512])
    ap.add_argument("--past", type=at_least(0), nargs="+", default=[0, 2048, 8192])
    ap.add_argument("--repeat", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(1), default=None, help="ONNX Runtime's intra-op threads")
    ap.add_argument("--json", action="store_true", help="rows as JSON instead of the table")
    args = ap.parse_args(argv)
    try:
        cfg = dataclasses.replace(K2Config.preset(args.config), num_attention_heads=args.heads,
                                  num_key_value_heads=args.heads)
        rows = measure(cfg, args.tokens, args.past, args.repeat, args.threads,
                       log=(lambda *a: None) if args.json else lambda s: print(s, file=sys.stderr))
    except K2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"config": args.config, "heads": args.heads, "rows": rows,
                      "crossings": crossings(rows)}) if args.json else table(args.config, cfg, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
