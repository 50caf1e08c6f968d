"""`python -m k2trt.tools.gpu_check` (`make gpu-check`): the Triton kernels at full Kimi K2 shapes on a
CUDA GPU — accuracy against the torch references of graphs/ (fp32 emulation, same functions the CPU tests use)
and time against plain torch (dequantize + per-expert loop, as moe_infer does), in one run of a few minutes. The
routed experts run twice: FP8 blocks (Kimi K2) and INT4 groups of 32 (K2-Thinking, K2.5), at the same shapes.

The measuring code is device-agnostic, so tests/test_kernels.py runs it on CPU at tiny shapes; only main()
insists on CUDA. `--compile-only` needs no GPU: it compiles every kernel variant for sm_90 (lowering, ptxas,
shared memory), which the CPU interpreter cannot check.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k2trt.config import K2Config
from k2trt.graphs.fp8 import BLOCK, PER_TOKEN_GROUP, cdiv, dequant_weight
from k2trt.graphs.fp8 import fp8_block_linear as ref_linear
from k2trt.graphs import int4
from k2trt.graphs.moe_ref import moe_fp8_reference, moe_int4_reference

NO_GPU = "gpu-check: needs a CUDA GPU (torch.cuda.is_available() is False)"
REL_TOL = 1e-2  # bf16 outputs plus rare one-step flips of the fp8 re-quantized h (see tests/test_kernels.py)
INT4_GROUP = 32  # K2-Thinking's and K2.5's group size


# ---------------------------------------------------------------------------------------------- cost model

def scale_bytes(n: int, k: int) -> int:
    return cdiv(n, BLOCK) * cdiv(k, BLOCK) * 4


def moe_bytes(num_tokens: int, experts_touched: int, d: int, inter: int, act_bytes: int) -> int:
    """Bytes that must be read: fp8 gate/up/down weights and scales of each distinct expert touched, plus x."""
    per_expert = 3 * d * inter + 2 * scale_bytes(inter, d) + scale_bytes(d, inter)
    return experts_touched * per_expert + num_tokens * d * act_bytes


def moe_int4_bytes(num_tokens: int, experts_touched: int, d: int, inter: int, act_bytes: int, group: int) -> int:
    """As moe_bytes for INT4 experts: half a byte per weight, a bf16 scale per group of `group`."""
    per_expert = 3 * d * inter // 2 + 3 * (d * inter // group) * 2
    return experts_touched * per_expert + num_tokens * d * act_bytes


def moe_flops(num_pairs: int, d: int, inter: int) -> int:
    return 2 * num_pairs * 3 * d * inter  # gate, up and down GEMMs per (token, expert) pair


def linear_bytes(m: int, n: int, k: int, act_bytes: int) -> int:
    return n * k + scale_bytes(n, k) + m * k * act_bytes


def linear_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


@dataclass
class Row:
    name: str
    tokens: int
    max_abs: float
    rel: float
    triton_ms: float
    torch_ms: float
    bytes: int
    flops: int
    checked_tokens: int

    @property
    def ok(self) -> bool:
        return self.rel <= REL_TOL

    def cells(self) -> list[str]:
        sec = max(self.triton_ms, 1e-9) * 1e-3
        return [self.name, str(self.tokens) + ("" if self.checked_tokens == self.tokens
                                               else f" ({self.checked_tokens} checked)"),
                f"{self.max_abs:.3e}", f"{self.rel:.2e}", f"{self.triton_ms:.3f}", f"{self.torch_ms:.3f}",
                f"{self.torch_ms / max(self.triton_ms, 1e-9):.2f}x", f"{self.bytes / sec / 1e12:.2f}",
                f"{self.flops / sec / 1e12:.1f}", "ok" if self.ok else "FAIL"]


HEADER = ["kernel", "tokens", "max abs err", "rel err", "triton ms", "torch ms", "speedup", "TB/s", "TFLOP/s",
          "check"]


def format_table(rows: list[Row], markdown: bool = False) -> str:
    cells = [HEADER] + [r.cells() for r in rows]
    if markdown:
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        lines.insert(1, "|" + "---|" * len(HEADER))
        return "\n".join(lines) + "\n"
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(HEADER))) for c in cells) + "\n"


def markdown_report(rows: list[Row], gpu: str, when: datetime.datetime | None = None) -> str:
    when = when or datetime.datetime.now(datetime.timezone.utc)
    import triton
    return (f"# k2trt gpu-check\n\n- date: {when:%Y-%m-%d %H:%M UTC}\n- GPU: {gpu}\n"
            f"- torch {torch.__version__}, triton {triton.__version__}\n"
            f"- rel err = max|triton − reference| / max|reference|; TB/s counts the bytes that must be read "
            f"(fp8 weights + scales of the experts touched, activations; for MLA decode every held cache row once); "
            f"the MLA rows' torch baseline gathers the pages first, as the block graphs do today; "
            f"check: rel err ≤ {REL_TOL}\n\n"
            + format_table(rows, markdown=True) + _bandwidth_notes(rows, gpu))


def _bandwidth_notes(rows: list[Row], gpu: str) -> str:
    from k2trt.tools.gpu_check_mla import bandwidth_lines
    lines = bandwidth_lines(rows, gpu)
    return "".join(["\n"] + [f"- {line}\n" for line in lines]) if lines else ""


# ---------------------------------------------------------------------------------------------- baselines

def torch_moe(x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s, dequant=dequant_weight):
    """Plain torch MoE as modeling_deepseek's moe_infer: sort pairs, per expert dequantize its weights to x's dtype
    (FP8 blocks, or INT4 groups with dequant=graphs.int4.dequant_weight) and run gate/up/down with F.linear,
    scatter back, weight and sum."""
    x2 = x.reshape(-1, x.shape[-1])
    k = topk_ids.shape[-1]
    ids = topk_ids.reshape(-1).long()
    order = ids.argsort()
    counts = torch.bincount(ids, minlength=gate_w.shape[0]).tolist()
    xs = x2[order // k]
    outs = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = xs[start:start + n]
        g = F.linear(t, dequant(gate_w[e], gate_s[e], x.dtype))
        u = F.linear(t, dequant(up_w[e], up_s[e], x.dtype))
        outs[start:start + n] = F.linear(F.silu(g) * u, dequant(down_w[e], down_s[e], x.dtype))
        start += n
    per_pair = torch.empty_like(outs)
    per_pair[order] = outs
    y = (per_pair.view(x2.shape[0], k, -1).float() * topk_weights.reshape(-1, k, 1).float()).sum(1)
    return y.to(x.dtype).reshape(x.shape)


def torch_linear(x, weight, scale_inv):
    return F.linear(x, dequant_weight(weight, scale_inv, x.dtype))


# ---------------------------------------------------------------------------------------------- measuring

def time_ms(fn, device: torch.device, warmup: int = 2, iters: int = 10, budget_s: float = 2.0) -> float:
    """Median wall time of fn() in ms (CUDA events on a GPU), at most iters runs or about budget_s seconds."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = device.type == "cuda"
    start_all = time.perf_counter()
    for _ in range(max(1, iters)):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        if time.perf_counter() - start_all > budget_s:
            break
    return sorted(times)[len(times) // 2]


def random_experts(num_experts: int, n: int, k: int, device, generator=None):
    """Random fp8 expert weights [E, n, k] with block scales; fp8 values ~N(0, 32²), dequantized std ≈ 1/√k."""
    w = torch.empty(num_experts, n, k, dtype=torch.float8_e4m3fn, device=device)
    for e in range(0, num_experts, 16):  # chunked: a full-size fp32 randn would need 4× the fp8 bytes
        chunk = torch.randn(min(16, num_experts - e), n, k, device=device, generator=generator) * 32
        w[e:e + 16] = chunk.clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(num_experts, cdiv(n, BLOCK), cdiv(k, BLOCK), device=device, generator=generator)
    return w, (s + 0.5) / (32 * k ** 0.5)


def random_int4_experts(num_experts: int, n: int, k: int, group: int, device, generator=None):
    """Random INT4 expert weights: packed int32 [E, n, k/8] (compressed-tensors' packing) and bf16 group scales
    [E, n, k/group], dequantized std ≈ 1/√k."""
    packed = torch.empty(num_experts, n, k // 8, dtype=torch.int32, device=device)
    for e in range(0, num_experts, 16):  # chunked: packing makes int32 copies of the int8 values
        q = torch.randint(-8, 8, (min(16, num_experts - e), n, k), device=device, generator=generator)
        packed[e:e + 16] = int4.pack(q.to(torch.int8))
    s = torch.rand(num_experts, n, k // group, device=device, generator=generator)
    return packed, ((s + 0.5) / (4.6 * k ** 0.5)).to(torch.bfloat16)


def random_routing(tokens: int, num_experts: int, top_k: int, device, generator=None):
    ids = torch.rand(tokens, num_experts, device=device, generator=generator).topk(top_k, dim=-1).indices
    w = torch.rand(tokens, top_k, device=device, generator=generator) + 0.1
    return ids.to(torch.int32), w / w.sum(-1, keepdim=True) * 2.827


def _err(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (y.float() - ref.float()).abs().max().item()
    return diff, diff / max(ref.float().abs().max().item(), 1e-30)


def check_moe(tokens_list, num_experts: int, d: int, inter: int, top_k: int, device, dtype=torch.bfloat16,
              activation_quant: int = PER_TOKEN_GROUP, max_check_tokens: int = 512, iters: int = 10,
              warmup: int = 2, seed: int = 0, log=None) -> list[Row]:
    from k2trt.runtime.kernels.moe import moe_fp8
    gen = torch.Generator(device=device).manual_seed(seed)
    gw, gs = random_experts(num_experts, inter, d, device, gen)
    uw, us = random_experts(num_experts, inter, d, device, gen)
    dw, ds = random_experts(num_experts, d, inter, device, gen)
    rows = []
    for t in tokens_list:
        x = torch.randn(t, d, device=device, generator=gen).to(dtype)
        ids, w = random_routing(t, num_experts, top_k, device, gen)
        args = (gw, gs, uw, us, dw, ds)
        y = moe_fp8(x, ids, w, *args, activation_quant=activation_quant)
        # tokens are independent (per-token quantization, per-row re-quantization): a prefix subset is a valid check
        c = min(t, max_check_tokens)
        ref = moe_fp8_reference(x[:c], ids[:c], w[:c], *args, activation_quant=activation_quant)
        max_abs, rel = _err(y[:c], ref)
        del ref
        tri = time_ms(lambda: moe_fp8(x, ids, w, *args, activation_quant=activation_quant), device, warmup, iters)
        tor = time_ms(lambda: torch_moe(x, ids, w, *args), device, min(warmup, 1), iters)
        touched = int(torch.unique(ids).numel())
        rows.append(Row(f"moe E{num_experts} top{top_k} d{d} I{inter}", t, max_abs, rel, tri, tor,
                        moe_bytes(t, touched, d, inter, x.element_size()), moe_flops(t * top_k, d, inter), c))
        if log:
            log(rows[-1])
    return rows


def check_moe_int4(tokens_list, num_experts: int, d: int, inter: int, top_k: int, group: int, device,
                   dtype=torch.bfloat16, max_check_tokens: int = 512, iters: int = 10, warmup: int = 2, seed: int = 0,
                   log=None) -> list[Row]:
    """The INT4 (W4A16) grouped GEMMs of K2-Thinking's experts, beside check_moe's FP8 ones."""
    from k2trt.runtime.kernels.moe_int4 import moe_int4
    gen = torch.Generator(device=device).manual_seed(seed)
    args = (*random_int4_experts(num_experts, inter, d, group, device, gen),
            *random_int4_experts(num_experts, inter, d, group, device, gen),
            *random_int4_experts(num_experts, d, inter, group, device, gen))
    rows = []
    for t in tokens_list:
        x = torch.randn(t, d, device=device, generator=gen).to(dtype)
        ids, w = random_routing(t, num_experts, top_k, device, gen)
        y = moe_int4(x, ids, w, *args, group_size=group)
        c = min(t, max_check_tokens)  # tokens are independent: a prefix subset is a valid check
        ref = moe_int4_reference(x[:c], ids[:c], w[:c], *args)
        max_abs, rel = _err(y[:c], ref)
        del ref
        tri = time_ms(lambda: moe_int4(x, ids, w, *args, group_size=group), device, warmup, iters)
        tor = time_ms(lambda: torch_moe(x, ids, w, *args, dequant=int4.dequant_weight), device, min(warmup, 1), iters)
        touched = int(torch.unique(ids).numel())
        rows.append(Row(f"moe int4 g{group} E{num_experts} top{top_k} d{d} I{inter}", t, max_abs, rel, tri, tor,
                        moe_int4_bytes(t, touched, d, inter, x.element_size(), group),
                        moe_flops(t * top_k, d, inter), c))
        if log:
            log(rows[-1])
    return rows


def check_linear(name: str, n: int, k: int, tokens_list, device, dtype=torch.bfloat16,
                 activation_quant: int = PER_TOKEN_GROUP, iters: int = 20, warmup: int = 3,
                 seed: int = 1, log=None) -> list[Row]:
    from k2trt.runtime.kernels.fp8_linear import fp8_block_linear
    gen = torch.Generator(device=device).manual_seed(seed)
    w, s = random_experts(1, n, k, device, gen)
    w, s = w[0], s[0]
    rows = []
    for t in tokens_list:
        x = torch.randn(t, k, device=device, generator=gen).to(dtype)
        y = fp8_block_linear(x, w, s, activation_quant)
        max_abs, rel = _err(y, ref_linear(x, w, s, activation_quant))
        tri = time_ms(lambda: fp8_block_linear(x, w, s, activation_quant), device, warmup, iters)
        tor = time_ms(lambda: torch_linear(x, w, s), device, warmup, iters)
        rows.append(Row(f"linear {name} {n}x{k}", t, max_abs, rel, tri, tor,
                        linear_bytes(t, n, k, x.element_size()), linear_flops(t, n, k), t))
        if log:
            log(rows[-1])
    return rows


MLA_BATCHES = (1, 8, 64)
MLA_POSITIONS = (1024, 8192, 32768)
MLA_PREFILL = ((1, 0, 4096), (1, 8192, 2048), (8, 1024, 512))  # (sequences, cached context, chunk)


def run_all(device, tokens_list, linear_tokens, activation_quant: int = PER_TOKEN_GROUP,
            cfg: K2Config | None = None, log=None, mla: bool = True) -> list[Row]:
    """The MoE at K2's shapes for each token count (FP8 experts, then INT4 experts as K2-Thinking stores them), the
    dense linear at q_a and o_proj shapes, then the paged MLA attention (k2trt/tools/gpu_check_mla.py)."""
    cfg = cfg or K2Config()
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    rows = check_moe(tokens_list, cfg.n_routed_experts, d, inter, cfg.num_experts_per_tok, device,
                     activation_quant=activation_quant, log=log)
    rows += check_moe_int4(tokens_list, cfg.n_routed_experts, d, inter, cfg.num_experts_per_tok, INT4_GROUP,
                           device, log=log)
    for name, n, k in (("q_a", cfg.q_lora_rank, d), ("o_proj", d, cfg.num_attention_heads * cfg.v_head_dim)):
        rows += check_linear(name, n, k, linear_tokens, device, activation_quant=activation_quant, log=log)
    if mla:
        from k2trt.tools import gpu_check_mla as m

        shape = dict(heads=cfg.num_attention_heads, latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim)
        rows += m.check_mla_decode(MLA_BATCHES, MLA_POSITIONS, device, **shape, log=log)
        rows += m.check_mla_prefill(MLA_PREFILL, device, **shape, nope=cfg.qk_nope_head_dim, v=cfg.v_head_dim,
                                    log=log)
    return rows


# ---------------------------------------------------------------------------------------------- compile only

SMEM_LIMIT = 227 * 1024  # shared memory one CTA may use on an H100 / H200


def kernel_variants(cfg: K2Config | None = None):
    """(label, kernel, pointer dtypes, constexprs, num_warps, num_stages) for each variant the JIT path launches at
    K2's shapes with bf16 activations, in both activation_quant modes (every MoE tactic, every linear tile)."""
    from k2trt.runtime.kernels import fp8_linear as fl
    from k2trt.runtime.kernels import moe
    from k2trt.runtime.kernels.moe_int4 import INT4_TACTICS
    from k2trt.runtime.aot import moe as aot_moe
    from k2trt.runtime.aot import moe_int4 as aot_moe_int4

    def variant(label, launch):  # the MoE kernels as their AOT plugins launch them
        return label, launch.kernel, launch.pointer_types(), launch.constexprs(), launch.num_warps, launch.num_stages

    cfg = cfg or K2Config()
    d, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    out = [("act_quant", fl.act_quant_kernel, {"x_ptr": "bf16", "q_ptr": "fp8e4nv"},
            dict(BLOCK_ROWS=16, GROUP=BLOCK), 4, 1),
           variant("moe combine", aot_moe.CombineLaunch(d, cfg.num_experts_per_tok, "bfloat16")),
           variant("moe align", aot_moe.AlignLaunch(e))]
    for aq in (0, 1):
        a = "fp8e4nv" if aq else "bf16"
        common = dict(A_FP8=bool(aq), ACT=1, DOT16=True, EVEN_K=True)
        lin = {fl.linear_config(m, n, k) for m in (1, 16, 64, 512, 4096)
               for n, k in ((cfg.q_lora_rank, d), (d, cfg.num_attention_heads * cfg.v_head_dim))}
        for c in sorted(lin, key=lambda c: (c.block_m, c.block_n)):
            out.append((f"linear aq{aq} {c.block_m}x{c.block_n}", fl.linear_kernel,
                        {"a_ptr": a, "b_ptr": "fp8e4nv", "c_ptr": "bf16"},
                        dict(BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m, **common),
                        c.num_warps, c.num_stages))
        for tactic, t in moe.GEMM_TACTICS.items():
            out.append(variant(f"moe gate_up aq{aq} BM{t.block_m}",
                               aot_moe.gemm_launch("gate_up", e, inter, d, "bfloat16", aq, tactic)))
            out.append(variant(f"moe down aq{aq} BM{t.block_m}",
                               aot_moe.gemm_launch("down", e, d, inter, "bfloat16", aq, tactic)))
    from k2trt.runtime.aot import mla as aot_mla  # the paged MLA kernels at their JIT tiles, bf16 and fp8 pools
    for pool in ("bfloat16", "float8_e4m3fn"):
        for launch in aot_mla.launches("bfloat16", pool, **aot_mla.k2_shape()):
            if not (pool != "bfloat16" and isinstance(launch, aot_mla.MergeLaunch)):  # the merge reads no pool
                out.append(variant(f"mla {launch.label} {pool}", launch))
    for tactic in INT4_TACTICS:  # W4A16: one mode; the tiles are moe_int4.int4_tiles' for bf16, as the JIT's
        for stage, out_cols, in_cols in (("gate_up", inter, d), ("down", d, inter)):
            launch = aot_moe_int4.int4_gemm_launch(stage, e, out_cols, in_cols, INT4_GROUP, "bfloat16", tactic)
            out.append(variant(f"moe int4 {stage} BM{launch.block_m} BK{launch.block_k}", launch))
    return out


def compile_check(arch: int = 90, log=print) -> list[str]:
    """Compile every kernel variant to a cubin for sm_<arch> (Triton's bundled ptxas; no GPU needed). Returns
    the failures. Pointers and integer arguments are declared 16-divisible, as the JIT specializes them at K2's
    shapes, so loads vectorize and pipeline as they will on the GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k2trt.runtime.kernels.fp8_linear import interpreting
    if interpreting():
        raise RuntimeError("compile_check needs compiled kernels: run it without TRITON_INTERPRET=1")
    import triton
    failures = []
    for label, fn, ptrs, consts, warps, stages in kernel_variants():
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            sig[name] = "*" + ptrs.get(name, "fp32") if name.endswith("_ptr") else "i32"
            if name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K", "D"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        t = time.perf_counter()
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
            smem = k.metadata.shared
            status = "ok" if smem <= SMEM_LIMIT else f"FAIL: {smem} B shared memory > {SMEM_LIMIT}"
        except Exception as e:  # noqa: BLE001 - report every variant, then fail
            smem, status = -1, f"FAIL: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if status != "ok":
            failures.append(f"{label}: {status}")
        log(f"{label:28s} warps {warps} stages {stages}  smem {smem:7d} B  {time.perf_counter() - t:5.1f} s  {status}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2trt.tools.gpu_check", description=__doc__)
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (date, GPU name)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="MoE token counts")
    p.add_argument("--linear-tokens", type=int, nargs="+", default=[1, 64, 4096])
    p.add_argument("--activation-quant", type=int, choices=(0, 1), default=PER_TOKEN_GROUP)
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: compile every kernel variant for sm_90 and report shared memory")
    args = p.parse_args(argv)
    if args.compile_only:
        failures = compile_check()
        for f in failures:
            print(f"gpu-check: {f}", file=sys.stderr)
        return 1 if failures else 0
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    print(f"gpu-check on {gpu}; K2 MoE shapes, bf16 activations, activation_quant={args.activation_quant}")
    print(format_table([]).rstrip())
    t0 = time.perf_counter()
    rows = run_all(device, args.tokens, args.linear_tokens, args.activation_quant,
                   log=lambda r: print(format_table([r]).splitlines()[-1], flush=True))
    print(f"\n{format_table(rows)}({time.perf_counter() - t0:.0f} s)")
    from k2trt.tools.gpu_check_mla import bandwidth_lines
    for line in bandwidth_lines(rows, gpu):
        print(line)
    if args.markdown:
        from k2trt.atomic import atomic_write_text
        atomic_write_text(args.markdown, markdown_report(rows, gpu))
        print(f"wrote {args.markdown}")
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"gpu-check: {len(bad)} row(s) above rel err {REL_TOL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
