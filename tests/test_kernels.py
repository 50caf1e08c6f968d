"""Triton kernels (runtime/kernels) against the torch references of graphs/fp8.py and graphs/moe_ref.py, on CPU
under TRITON_INTERPRET=1 (conftest), at small shapes.

Tolerances (tests/tolerances.py): elementwise one ulp of the output dtype plus TIGHT = 1e-5 of max|reference|
for the fp32 summation order; FLIP = 2e-3 of max|reference| for end-to-end W8A8 MoE and 16-bit activations: the
gate/up sums differ from the reference in the last fp32 bit, which now and then moves an element of h across an
fp8 (or bf16) rounding boundary: one step of 1/8..1/16 of that element, carried through the down GEMM.
test_gate_up_stage checks that every such difference is exactly one fp8 step and rare.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from tolerances import TIGHT, assert_close  # noqa: E402

from k2trt.graphs import fp8 as ref  # noqa: E402
from k2trt.graphs import moe_ref  # noqa: E402
from k2trt.graphs.moe_ref import moe_fp8_reference  # noqa: E402
from k2trt.tools import gpu_check  # noqa: E402
from k2trt.runtime.kernels.fp8_linear import LinearConfig, fp8_block_linear, quantize_activation  # noqa: E402
from k2trt.runtime.kernels import moe  # noqa: E402

FLIP = 2e-3
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _close(y, r, tol):
    assert_close(y, r, tol)


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
        _close(y, r, TIGHT)


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
    _close(out, ref.fp8_block_linear(x, w, s, 1), TIGHT)


# ---------------------------------------------------------------------------------------------- alignment

ALIGN_CASES = {
    "top8": lambda: _routing(13, 16, 8)[0],
    "k2_experts": lambda: _routing(40, 384, 8)[0],  # K2's expert count, several 64-pair chunks
    "e_not_pow2": lambda: torch.tensor([[0, 2], [4, 2]], dtype=torch.int32),
    "all_to_one": lambda: torch.full((9, 2), 5, dtype=torch.int32),
    "one_token": lambda: torch.tensor([[3, 0, 7]], dtype=torch.int32),
    "most_empty": lambda: torch.tensor([[1], [1], [14], [1]], dtype=torch.int32),
    "out_of_range": lambda: torch.tensor([[-3, 2], [99, 1 << 30]], dtype=torch.int32),  # clamped, as TRT timing
}


@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_moe_align_is_the_reference_exactly(case):
    ids = ALIGN_CASES[case]()
    e = {"k2_experts": 384, "e_not_pow2": 5}.get(case, 16)
    sorted_pairs = torch.full((ids.numel(),), -7, dtype=torch.int32)  # poisoned: every element must be written
    offsets = torch.full((e + 1,), -7, dtype=torch.int32)
    moe.moe_align(ids, e, sorted_pairs, offsets)
    want = moe_ref.moe_align_reference(ids, e)
    assert torch.equal(sorted_pairs, want[0]) and torch.equal(offsets, want[1])
    assert int(offsets[-1]) == ids.numel() and torch.equal(sorted_pairs.sort().values, torch.arange(ids.numel(),
                                                                                                      dtype=torch.int32))


def test_gemm_tile_bound_covers_any_routing():
    """The grid of a grouped GEMM covers Σ_e ceil(count_e / BM) for any split of n pairs over E experts: random
    splits and the worst one (every touched expert one pair past a full tile)."""
    gen = torch.Generator().manual_seed(12)
    for n, e in ((1, 384), (8, 384), (64, 16), (3000, 384), (5, 2)):
        for t in moe.GEMM_TACTICS.values():
            bound = moe.gemm_tiles_bound(n, e, t.block_m)
            splits = [torch.bincount(torch.randint(0, e, (n,), generator=gen), minlength=e).tolist()
                      for _ in range(20)]
            touched = min(n, e)
            worst = [1 + t.block_m * ((n - touched) // touched)] * touched
            worst[0] += n - sum(worst)
            for counts in splits + [worst]:
                assert sum(counts) == n and bound >= sum(-(-c // t.block_m) for c in counts), (n, e, t)


# ---------------------------------------------------------------------------------------------- MoE

@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aq", [0, 1])
def test_moe_matches_reference(experts, dtype, aq):
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids, w = _routing(12, 16, 4, seed=4)
    y = moe.moe_fp8(x, ids, w, *experts, activation_quant=aq)
    r = moe_fp8_reference(x, ids, w, *experts, activation_quant=aq)
    assert y.dtype == dtype and y.shape == x.shape
    _close(y, r, TIGHT if (dtype == torch.float32 and aq == 0) else FLIP)


ROUTINGS = {
    "top8": lambda: _routing(6, 16, 8, seed=5),
    "all_one_expert": lambda: (torch.full((10, 2), 7, dtype=torch.int32), torch.rand(10, 2)),  # skewed
    "empty_experts": lambda: (torch.tensor([[0, 15], [15, 3], [0, 3]], dtype=torch.int32), torch.rand(3, 2)),
    "one_token": lambda: _routing(1, 16, 8, seed=6),
}


@pytest.mark.slow
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("aq", [0, 1])
def test_moe_routing_cases_write_every_output(experts, routing, aq):
    """Each stage into poisoned buffers (NaN / garbage), as TensorRT hands over uninitialized ones."""
    ids, w = ROUTINGS[routing]()
    t, k = ids.shape
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    n = t * k
    sp, off = moe.moe_align(ids, 16, torch.full((n,), 9999, dtype=torch.int32),
                            torch.full((17,), -1, dtype=torch.int32))
    h_dtype = torch.float8_e4m3fn if aq else torch.bfloat16
    h = torch.full((n, 128), float("nan")).to(h_dtype)
    hs = torch.full((n, 1), float("nan"))
    moe.moe_gate_up(x, sp, off, *experts[:4], aq, h=h, h_scale=hs)
    assert not hs.isnan().any() and not h.float().isnan().any()
    pair_out = moe.moe_down(h, hs, sp, off, *experts[4:], aq, torch.bfloat16,
                            out=torch.full((n, 256), float("nan"), dtype=torch.bfloat16))
    assert not pair_out.isnan().any()
    y = moe.moe_combine(pair_out, w, out=torch.full((t, 256), float("nan"), dtype=torch.bfloat16))
    assert not y.isnan().any()
    _close(y, moe_fp8_reference(x, ids, w, *experts, activation_quant=aq), FLIP)


@pytest.mark.slow
@pytest.mark.parametrize("tactic", sorted(moe.GEMM_TACTICS))
def test_moe_every_tactic_and_batch_shape(experts, tactic):
    """3-D x, int64 ids, each tile height TensorRT may pick; W8A16 fp32 is exact to summation order."""
    x = torch.randn(2, 20, 256, generator=torch.Generator().manual_seed(8))
    ids, w = _routing(40, 16, 3, seed=8)
    ids, w = ids.long().view(2, 20, 3), w.view(2, 20, 3)
    for aq in (0, 1):
        y = moe.moe_fp8(x, ids, w, *experts, activation_quant=aq, tactic=tactic)
        _close(y, moe_fp8_reference(x, ids, w, *experts, activation_quant=aq), TIGHT if aq == 0 else FLIP)


def test_moe_w8a16_dims_not_multiple_of_128():
    """W8A16 allows any d and I: masked K tails in both GEMMs, partial N tiles, partial scale blocks."""
    gen = torch.Generator().manual_seed(10)
    ex = (*_experts(gen, 4, 100, 200), *_experts(gen, 4, 100, 200), *_experts(gen, 4, 200, 100))
    x = torch.randn(5, 200, generator=gen)
    ids, w = _routing(5, 4, 2, seed=10)
    _close(moe.moe_fp8(x, ids, w, *ex, activation_quant=0), moe_fp8_reference(x, ids, w, *ex, activation_quant=0),
           TIGHT)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe.moe_fp8(x, ids, w, *ex, activation_quant=1)


def _stage_inputs(experts, dtype, aq, t=16, k=4, seed=9):
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ids, w = _routing(t, 16, k, seed=seed)
    sp, off = moe.moe_align(ids, 16)
    h, hs = moe.moe_gate_up(x, sp, off, *experts[:4], aq, tactic=1)
    return x, sp, off, w, h, hs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_stage(experts, dtype):
    """h against the MoeGateUp reference: W8A16 to one ulp; W8A8 scales to one ulp of x's dtype (the amax is an
    element of h in x's dtype), fp8 codes at most one step apart and rarely."""
    for aq in (0, 1):
        x, sp, off, _, h, hs = _stage_inputs(experts, dtype, aq)
        h_ref, hs_ref = moe_ref.moe_gate_up_reference(x, sp, off, *experts[:4], aq)
        if aq == 0:
            _close(h, h_ref, TIGHT)
            assert torch.equal(hs, hs_ref)  # ones
            continue
        assert_close(hs, hs_ref, TIGHT, dtype=dtype)
        code = lambda q: torch.where(q.float() < 0, -1, 1) * (q.view(torch.uint8) & 0x7F).int()  # noqa: E731
        steps = (code(h) - code(h_ref)).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01  # rare one-step fp8 flips only


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aq", [0, 1])
def test_down_and_combine_stages(experts, dtype, aq):
    """Given the kernel's own h, the down GEMM and the weighted combine match their references to fp32 summation
    order (one ulp of the output dtype)."""
    x, sp, off, w, h, hs = _stage_inputs(experts, dtype, aq)
    pair_out = moe.moe_down(h, hs, sp, off, *experts[4:], aq, dtype, tactic=2)
    _close(pair_out, moe_ref.moe_down_reference(h, hs, sp, off, *experts[4:], aq, dtype), TIGHT)
    y = moe.moe_combine(pair_out, w)
    _close(y, moe_ref.moe_combine_reference(pair_out, w), TIGHT)


def test_stages_survive_garbage_indices(experts):
    """TensorRT times each plugin on uninitialized inputs: stray pair ids and offsets must stay in bounds."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 256, generator=gen)
    n = 8
    sp = torch.randint(-1 << 30, 1 << 30, (n,), generator=gen, dtype=torch.int32)
    off = torch.randint(-1 << 30, 1 << 30, (17,), generator=gen, dtype=torch.int32)
    for aq in (0, 1):
        h, hs = moe.moe_gate_up(x, sp, off, *experts[:4], aq, tactic=1)
        moe.moe_down(h, hs, sp, off, *experts[4:], aq, torch.float32, tactic=1)


def test_tactic_table():
    assert moe.default_tactic(8, 384) == 1  # decode
    assert moe.default_tactic(4096 * 8, 384) == 3  # prefill
    with pytest.raises(ValueError, match="block_n == 128"):
        moe.check_gemm(moe.GemmTiles(block_m=16, block_n=64), gate_up=True)


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


def test_gpu_check_mla_cost_model():
    from k2trt.tools import gpu_check_mla as m

    # 8 sequences of 32k positions at K2's widths, a bf16 pool: 8 · (32768 · 576 · 2 + 512 · 4 + 64 · 1088 · 2)
    assert m.mla_decode_bytes(8, 32768, 1, 64, 512, 64, 2, 2) == 8 * (32768 * 576 * 2 + 512 * 4 + 64 * 1088 * 2)
    assert m.mla_decode_flops(1, 100, 2, 4, 512, 64) == 2 * 2 * 4 * 100 * 1088
    # a whole 4-token prompt: decompress 4 positions, then 1 + 2 + 3 + 4 positions seen
    assert m.mla_prefill_flops(1, 0, 4, 2, 512, 128, 64, 128) == 2 * 4 * 2 * 256 * 512 + 2 * 2 * 10 * 320
    assert m.bandwidth_share(2.4, "NVIDIA H100 80GB HBM3") == pytest.approx(2.4 / 3.35)
    assert m.bandwidth_share(2.4, "NVIDIA H100 PCIe") == pytest.approx(1.2)
    assert m.bandwidth_share(2.4, "cpu") is None


def test_gpu_check_mla_rows_on_cpu():
    """The MLA rows' measuring code on CPU at tiny widths (interpreted kernels, one timing run each): the paged
    kernels agree with the references and with the gather-then-attend baselines they are timed against."""
    from k2trt.tools import gpu_check_mla as m

    cpu = torch.device("cpu")
    shape = dict(heads=2, latent=64, rope=16)
    rows = m.check_mla_decode([2], [100], cpu, **shape, dtype=torch.float32, iters=1, warmup=0)
    rows += m.check_mla_prefill([(2, 70, 5), (1, 0, 9)], cpu, **shape, nope=32, v=32, dtype=torch.float32,
                                iters=1, warmup=0)
    assert [r.name for r in rows] == ["mla decode paged B2 P100", "mla prefill paged B2 ctx70 T5",
                                      "mla prefill paged B1 ctx0 T9"]
    assert all(r.ok and r.triton_ms > 0 and r.torch_ms > 0 for r in rows), gpu_check.format_table(rows)
    gen = torch.Generator().manual_seed(0)
    pool, tables, lengths = m.paged_pool(2, 100, 80, torch.float32, cpu, gen)
    q = torch.randn(2, 1, 2, 80, generator=gen)
    from k2trt.runtime.kernels.mla_decode import mla_decode
    assert torch.allclose(m.torch_decode(q, pool, tables, 100, 0.1, 64),
                          mla_decode(q, pool, tables, lengths, 0.1, page_tokens=m.PAGE, latent_dim=64), atol=1e-5)
    q = torch.randn(1, 5, 2, 48, generator=gen)
    new = torch.randn(1, 5, 80, generator=gen)
    wkv = torch.randn(2 * 64, 64, generator=gen) * 0.1
    from k2trt.runtime.kernels.mla_prefill import mla_prefill
    ctx = torch.tensor([70], dtype=torch.int32)
    assert torch.allclose(m.torch_prefill(q, pool, tables[:1], 70, new, wkv, 0.1, 64, 32, 32),
                          mla_prefill(q, pool, tables[:1], ctx, torch.tensor([5], dtype=torch.int32), wkv, 0.1,
                                      page_tokens=m.PAGE, v_head_dim=32, latent_dim=64, new=new), atol=1e-5)
    text = gpu_check.markdown_report(rows, "NVIDIA H100 80GB HBM3")
    assert "of NVIDIA H100 80GB HBM3's peak" in text


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
