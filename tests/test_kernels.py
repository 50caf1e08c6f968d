"""Triton kernels (runtime/kernels) against the torch references of graphs/fp8.py and graphs/moe_ref.py, on CPU
under TRITON_INTERPRET=1 (conftest), at small shapes.

Tolerances, relative to max|reference|:
  * TIGHT = 1e-5: fp32 activations where only the fp32 summation order differs (W8A16 everywhere; the W8A8 linear,
    whose activation quantization is bit-exact; the MoE down GEMM and combine given the same h).
  * FLIP = 2e-3: end-to-end W8A8 MoE and 16-bit activations. The gate/up sums differ from the reference in the last
    fp32 bit, which now and then moves an element of h across an fp8 (or bf16) rounding boundary: one step of
    1/8..1/16 of that element, carried through the down GEMM. test_gate_up_stage checks that every such
    difference is exactly one fp8 step and rare.
Elementwise for the dense linear with 16-bit outputs: one ulp of the output dtype (rtol 2^-7 bf16, 2^-10 fp16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from k2trt.graphs import fp8 as ref  # noqa: E402
from k2trt.graphs.moe_ref import moe_fp8_reference  # noqa: E402
from k2trt.tools import gpu_check  # noqa: E402
from k2trt.runtime.kernels.fp8_linear import LinearConfig, fp8_block_linear, quantize_activation  # noqa: E402
from k2trt.runtime.kernels.moe import (MoeConfig, align_capacity, moe_align, moe_combine, moe_config,  # noqa: E402
                                       moe_down, moe_fp8, moe_gate_up)

TIGHT = 1e-5
FLIP = 2e-3
OUT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # one ulp
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _close(y, r, tol, rtol=0.0):
    torch.testing.assert_close(y.float(), r.float(), rtol=rtol, atol=tol * r.float().abs().max().item() + 1e-30)


def _experts(gen, e, n, k, scale=0.1):
    return ref.quantize_weight(torch.randn(e, n, k, generator=gen) * scale)


@pytest.fixture(scope="module")
def experts():
    """E=16 experts, d=256, I=128 (gate, up, down weights and scales)."""
    gen = torch.Generator().manual_seed(0)
    return (*_experts(gen, 16, 128, 256), *_experts(gen, 16, 128, 256), *_experts(gen, 16, 256, 128))


def _routing(t, e, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    return ids, torch.rand(t, k, generator=gen) + 0.1


# ---------------------------------------------------------------------------------------------- dense linear

@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quant_bit_exact(dtype):
    x = torch.randn(5, 384) * 3
    x[1] = 0.0  # amax floor 1e-4
    x[2, :128] *= 1e-6  # subnormal e4m3 values
    x[3] *= 300.0  # still finite in fp16
    x = x.to(dtype)
    q, s = quantize_activation(x)
    rq, rs = ref.quantize_activation(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aq", [0, 1])
def test_linear_matches_reference(dtype, aq):
    gen = torch.Generator().manual_seed(1)
    w, s = ref.quantize_weight(torch.randn(200, 256, generator=gen))  # N = 200: a partial edge block in N
    for shape in ((1, 256), (2, 3, 256), (37, 256)):
        x = torch.randn(*shape, generator=gen).to(dtype)
        y = fp8_block_linear(x, w, s, aq)
        r = ref.fp8_block_linear(x, w, s, aq)
        assert y.dtype == dtype and y.shape == r.shape
        _close(y, r, TIGHT, OUT_RTOL[dtype])


def test_linear_w8a16_uneven_k_and_out():
    gen = torch.Generator().manual_seed(2)
    w, s = ref.quantize_weight(torch.randn(130, 200, generator=gen))  # K = 200: masked K tail
    x = torch.randn(3, 200, generator=gen)
    out = torch.full((3, 130), float("nan"))
    y = fp8_block_linear(x, w, s, 0, out=out)
    assert y is out and not out.isnan().any()
    _close(out, ref.fp8_block_linear(x, w, s, 0), TIGHT)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_block_linear(x, w, s, 1)
    with pytest.raises(ValueError, match="activation_quant"):
        fp8_block_linear(x, w, s, 2)


def test_linear_grouped_tile_order():
    """Several row tiles with a partial GROUP_M group (the prefill launch order)."""
    gen = torch.Generator().manual_seed(4)
    w, s = ref.quantize_weight(torch.randn(200, 256, generator=gen))
    x = torch.randn(37, 256, generator=gen)
    for aq in (0, 1):
        y = fp8_block_linear(x, w, s, aq, config=LinearConfig(block_m=16, block_n=32, group_m=2))
        _close(y, ref.fp8_block_linear(x, w, s, aq), TIGHT)


def test_linear_out_nan_filled_bf16():
    gen = torch.Generator().manual_seed(3)
    w, s = ref.quantize_weight(torch.randn(300, 128, generator=gen))
    x = torch.randn(1, 128, generator=gen).bfloat16()
    out = torch.full((1, 300), float("nan"), dtype=torch.bfloat16)
    fp8_block_linear(x, w, s, 1, out=out)
    assert not out.isnan().any()
    _close(out, ref.fp8_block_linear(x, w, s, 1), TIGHT, OUT_RTOL[torch.bfloat16])


# ---------------------------------------------------------------------------------------------- alignment

def _check_alignment(ids, e, bm):
    al = moe_align(ids, e, bm, method="triton")
    al_torch = moe_align(ids, e, bm, method="torch")  # the prefill path: same result exactly
    assert all(torch.equal(a, b) for a, b in zip(al[:3], al_torch[:3]))
    flat = ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=e)
    total = int(al.num_padded.item())
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    assert al.capacity == align_capacity(n, e, bm) >= total and al.capacity % bm == 0
    sid = al.sorted_ids.long()
    assert (sid[total:] == n).all()  # past the total: sentinel only
    real = sid[:total][sid[:total] < n]
    assert torch.equal(real.sort().values, torch.arange(n))  # every pair exactly once
    tiles = al.tile_experts.long()
    assert tiles.numel() == al.capacity // bm
    assert (tiles[total // bm:] == -1).all() and (tiles[:total // bm] >= 0).all()
    assert (tiles[:total // bm].diff() >= 0).all()  # experts in order
    for t in range(total // bm):  # every row of a tile is a pair of that tile's expert, or padding
        rows = sid[t * bm:(t + 1) * bm]
        assert (flat[rows[rows < n]] == tiles[t]).all()
    for x in range(e):  # each expert: ceil(count/bm) tiles, its pairs in token order, padding at the end
        mine = (tiles == x).nonzero().flatten()
        assert mine.numel() == -(-int(counts[x]) // bm)
        if mine.numel():
            seg = sid[mine[0] * bm:(mine[-1] + 1) * bm]
            c = int(counts[x])
            assert torch.equal(seg[:c], (flat == x).nonzero().flatten()) and (seg[c:] == n).all()
    return al


@pytest.mark.parametrize("bm", [1, 4, 16])
def test_moe_align(bm):
    ids, _ = _routing(13, 16, 8)
    _check_alignment(ids, 16, bm)
    _check_alignment(_routing(40, 384, 8)[0], 384, bm)  # K2's expert count, several 64-pair chunks
    _check_alignment(torch.tensor([[0, 2], [4, 2]]), 5, bm)  # E not a power of two
    _check_alignment(torch.full((9, 2), 5, dtype=torch.int32), 16, bm)  # all to one expert, duplicates
    _check_alignment(torch.tensor([[3, 0, 7]]), 16, bm)  # one token (int64 ids)
    _check_alignment(torch.tensor([[1], [1], [14], [1]]), 16, bm)  # most experts empty


# ---------------------------------------------------------------------------------------------- MoE

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aq", [0, 1])
def test_moe_matches_reference(experts, dtype, aq):
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids, w = _routing(12, 16, 4, seed=4)
    y = moe_fp8(x, ids, w, *experts, activation_quant=aq)
    r = moe_fp8_reference(x, ids, w, *experts, activation_quant=aq)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, r, TIGHT if (dtype == torch.float32 and aq == 0) else FLIP)


ROUTINGS = {
    "top8": lambda: _routing(6, 16, 8, seed=5),
    "all_one_expert": lambda: (torch.full((10, 2), 7, dtype=torch.int32), torch.rand(10, 2)),
    "zero_token_experts": lambda: (torch.tensor([[0, 15], [15, 3], [0, 3]], dtype=torch.int32), torch.rand(3, 2)),
    "one_token": lambda: _routing(1, 16, 8, seed=6),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("aq", [0, 1])
def test_moe_routing_cases(experts, routing, aq):
    ids, w = ROUTINGS[routing]()
    x = torch.randn(ids.shape[0], 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = torch.full_like(x, float("nan"))
    y = moe_fp8(x, ids, w, *experts, activation_quant=aq, out=out)
    assert y is out and not out.isnan().any()  # every output element written
    _close(out, moe_fp8_reference(x, ids, w, *experts, activation_quant=aq), FLIP)


def test_moe_prefill_tiles_and_batch_shape(experts):
    """3-D x, int64 ids, the 64-row prefill tiles and a 64-wide down tile."""
    x = torch.randn(2, 20, 256, generator=torch.Generator().manual_seed(8))
    ids, w = _routing(40, 16, 3, seed=8)
    ids, w = ids.long().view(2, 20, 3), w.view(2, 20, 3)
    cfg = MoeConfig(block_m=64, block_n_down=64)
    for aq in (0, 1):
        y = moe_fp8(x, ids, w, *experts, activation_quant=aq, config=cfg)
        _close(y, moe_fp8_reference(x, ids, w, *experts, activation_quant=aq), TIGHT if aq == 0 else FLIP)


def test_moe_w8a16_dims_not_multiple_of_128():
    """W8A16 allows any d and I: masked K tails in both GEMMs, partial N tiles, partial scale blocks."""
    gen = torch.Generator().manual_seed(10)
    ex = (*_experts(gen, 4, 100, 200), *_experts(gen, 4, 100, 200), *_experts(gen, 4, 200, 100))
    x = torch.randn(5, 200, generator=gen)
    ids, w = _routing(5, 4, 2, seed=10)
    _close(moe_fp8(x, ids, w, *ex, activation_quant=0), moe_fp8_reference(x, ids, w, *ex, activation_quant=0), TIGHT)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_fp8(x, ids, w, *ex, activation_quant=1)


def _stage_inputs(experts, dtype, aq, t=16, k=4, seed=9):
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ids, w = _routing(t, 16, k, seed=seed)
    cfg = MoeConfig(block_m=16)
    al = moe_align(ids, 16, cfg.block_m)
    h, hs = moe_gate_up(x, al, k, *experts[:4], aq, cfg)
    sid = al.sorted_ids.long()
    total = int(al.num_padded.item())
    n = t * k
    row_of_pair = torch.empty(n, dtype=torch.long)
    row_of_pair[sid[:total][sid[:total] < n]] = (sid[:total] < n).nonzero().flatten()
    return x, ids.reshape(-1).long(), w, cfg, al, h, hs, row_of_pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_stage(experts, dtype):
    """h against silu(gate(x))·up(x) in x's dtype, re-quantized as graphs/fp8.quantize_activation (W8A8)."""
    gw, gs, uw, us = experts[:4]
    for aq in (0, 1):
        x, flat, _, _, al, h, hs, rop = _stage_inputs(experts, dtype, aq)
        xs = x[torch.arange(flat.numel()) // 4]
        g = torch.stack([ref.fp8_block_linear(xs[p:p + 1], gw[e], gs[e], aq)[0] for p, e in enumerate(flat)])
        u = torch.stack([ref.fp8_block_linear(xs[p:p + 1], uw[e], us[e], aq)[0] for p, e in enumerate(flat)])
        h_ref = F.silu(g) * u
        pad = al.sorted_ids[:int(al.num_padded.item())] >= flat.numel()
        if aq == 0:
            _close(h[rop], h_ref, TIGHT, OUT_RTOL[dtype])
            assert (h[:pad.numel()][pad] == 0).all()
            continue
        q_ref, s_ref = ref.quantize_activation(h_ref)
        torch.testing.assert_close(hs[rop], s_ref, rtol=TIGHT, atol=0)
        code = lambda q: torch.where(q.float() < 0, -1, 1) * (q.view(torch.uint8) & 0x7F).int()  # noqa: E731
        steps = (code(h[rop]) - code(q_ref)).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01  # rare one-step fp8 flips only
        assert (h[:pad.numel()][pad].float() == 0).all()  # padding rows: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aq", [0, 1])
def test_down_and_combine_stages(experts, dtype, aq):
    """Given the kernel's own h, the down GEMM and the weighted combine match torch to fp32 summation order."""
    dw, ds = experts[4:]
    x, flat, w, cfg, al, h, hs, rop = _stage_inputs(experts, dtype, aq)
    n = flat.numel()
    pair_out = moe_down(h, hs, al, n, dw, ds, dtype, cfg)
    a = ref.dequant_activation(h[rop], hs[rop]) if aq else h[rop].float()
    wdt = torch.float32 if aq else dtype  # W8A16 rounds the dequantized weight to x's dtype, W8A8 does not
    wd = [ref.dequant_weight(dw[e], ds[e], wdt).float() for e in range(16)]
    o_ref = torch.stack([a[p] @ wd[e].T for p, e in enumerate(flat)]).to(dtype)
    _close(pair_out, o_ref, TIGHT, OUT_RTOL[dtype])
    y = torch.full((x.shape[0], 256), float("nan"), dtype=dtype)
    moe_combine(pair_out, w, y)
    y_ref = (pair_out.view(-1, 4, 256).float() * w.unsqueeze(-1)).sum(1).to(dtype)
    _close(y, y_ref, TIGHT, OUT_RTOL[dtype])


def test_moe_config_table():
    assert moe_config(1, 8, 384).block_m == 16  # decode
    assert moe_config(4096, 8, 384).block_m == 64  # prefill
    with pytest.raises(ValueError, match="block_n_gate_up"):
        x = torch.randn(1, 256)
        moe_fp8(x, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), *_experts_cpu_tiny(),
                config=MoeConfig(block_m=16, block_n_gate_up=64))


def _experts_cpu_tiny():
    gen = torch.Generator().manual_seed(0)
    return (*_experts(gen, 2, 128, 256), *_experts(gen, 2, 128, 256), *_experts(gen, 2, 256, 128))


# ---------------------------------------------------------------------------------------------- gpu_check

def test_gpu_check_cost_model():
    # 2 tokens, 3 experts touched, d=256, I=128, bf16: 3·(3·256·128 fp8 + (2+2+2)·4 scale bytes) + 2·256·2
    assert gpu_check.moe_bytes(2, 3, 256, 128, 2) == 3 * (3 * 256 * 128 + 6 * 4) + 2 * 256 * 2
    assert gpu_check.moe_flops(16, 256, 128) == 16 * 6 * 256 * 128
    assert gpu_check.linear_bytes(4, 200, 256, 2) == 200 * 256 + 2 * 2 * 4 + 4 * 256 * 2
    assert gpu_check.linear_flops(4, 200, 256) == 2 * 4 * 200 * 256
    row = gpu_check.Row("moe", 8, 1e-3, 1e-4, 2.0, 6.0, 4 * 10 ** 9, 6 * 10 ** 12, 8)
    assert row.cells()[6:9] == ["3.00x", "2.00", "3000.0"] and row.ok
    table = gpu_check.format_table([row], markdown=True).splitlines()
    assert table[0].startswith("| kernel | tokens") and table[1] == "|" + "---|" * 10 and len(table) == 3


def test_gpu_check_needs_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err.strip() == gpu_check.NO_GPU


def test_gpu_check_pipeline_on_cpu(tmp_path):
    """The GPU run's measuring code, on CPU at tiny shapes (one timing run each)."""
    cpu = torch.device("cpu")
    rows = gpu_check.check_moe([1, 5], 8, 256, 128, 2, cpu, iters=1, warmup=0, max_check_tokens=4)
    rows += gpu_check.check_linear("t", 200, 256, [2], cpu, iters=1, warmup=0)
    assert [r.tokens for r in rows] == [1, 5, 2] and rows[1].checked_tokens == 4
    assert all(r.ok and r.triton_ms > 0 and r.torch_ms > 0 for r in rows), gpu_check.format_table(rows)
    text = gpu_check.markdown_report(rows, "cpu (test)")
    assert "GPU: cpu (test)" in text and text.count("\n| ") == 4
    from k2trt.atomic import atomic_write_text
    atomic_write_text(tmp_path / "r.md", text)
    assert (tmp_path / "r.md").read_text() == text


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Every kernel variant the config tables launch compiles to an sm_90 cubin (Triton's bundled ptxas, no GPU):
    catches GPU lowering errors the interpreter cannot, e.g. in the bf16 tensor-core W8A16 path."""
    import os
    import subprocess
    import sys
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton has no CUDA backend here: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "k2trt.tools.gpu_check", "--compile-only"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") >= 20, r.stdout


def test_gpu_check_without_a_gpu_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the CPU-only message")
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().err.strip() == gpu_check.NO_GPU
