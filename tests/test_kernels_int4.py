"""The INT4 (W4A16) MoE kernels (runtime/kernels/moe_int4.py) against graphs/moe_ref.py's MoeInt4 references, on CPU
under TRITON_INTERPRET=1 (conftest), at small shapes. The weights are bf16 values (bf16(q·s)) multiplied in fp32:
fp32 results match to summation order; 16-bit outputs to one ulp of their dtype, plus FLIP where an element of h
crosses a rounding boundary of the activation dtype (as in tests/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from test_kernels import _routing  # noqa: E402  (the FP8 kernels' routings: distinct experts per token)
from tolerances import TIGHT, assert_close  # noqa: E402

from k2trt.graphs import int4 as ref  # noqa: E402
from k2trt.graphs import moe_ref  # noqa: E402
from k2trt.runtime.kernels import moe, moe_int4  # noqa: E402

FLIP = 2e-3
G = 32


def _experts(gen, e, n, k, group=G):
    q, s = ref.quantize_weight(torch.randn(e, n, k, generator=gen) * 0.1, group)
    return ref.pack(q), s


# float32 runs the FMA path at a small K step: many more interpreted iterations than the 16-bit dot (seconds each)
DTYPES = [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def experts():
    """E=16 experts, d=256, I=128: gate, up, down as (packed, scales)."""
    gen = torch.Generator().manual_seed(0)
    return (*_experts(gen, 16, 128, 256), *_experts(gen, 16, 128, 256), *_experts(gen, 16, 256, 128))


@pytest.mark.parametrize("dtype", [DTYPES[0], torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_moe_int4_matches_reference(experts, dtype):
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids, w = _routing(12, 16, 4, seed=4)
    y = moe_int4.moe_int4(x, ids, w, *experts, group_size=G)
    r = moe_ref.moe_int4_reference(x, ids, w, *experts)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, r, TIGHT if dtype == torch.float32 else FLIP)


@pytest.mark.slow  # every tactic in every dtype: the sweep (test_moe_int4_matches_reference is the quick check)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tactic", sorted(moe_int4.INT4_TACTICS))
def test_every_tactic_and_the_stages(experts, tactic, dtype):
    """3-D x, int64 ids, every tile TensorRT may pick in every activation dtype (each dtype has its own tiles and dot
    mode: moe_int4.int4_tiles, int4_dot_mode); each stage against its own reference, into poisoned buffers
    (TensorRT hands over uninitialized ones); the whole node once per tactic, in bf16: its align and combine do not
    depend on the dtype's tiles, and bf16 is the dtype whose stages the interpreter runs fastest (fp32's FMA K step
    of 16 is a half to a quarter of bf16's tiles'; test_moe_int4_matches_reference runs the whole node in fp32)."""
    tol = TIGHT if dtype == torch.float32 else FLIP
    x = torch.randn(2, 10, 256, generator=torch.Generator().manual_seed(8)).to(dtype)
    ids, w = _routing(20, 16, 3, seed=8)
    ids, w = ids.long().view(2, 10, 3), w.view(2, 10, 3)
    if dtype == torch.bfloat16:
        assert_close(moe_int4.moe_int4(x, ids, w, *experts, group_size=G, tactic=tactic),
                     moe_ref.moe_int4_reference(x, ids, w, *experts), tol)
    sp, off = moe.moe_align(ids, 16)
    n = sp.numel()
    h = moe_int4.moe_gate_up_int4(x.view(-1, 256), sp, off, *experts[:4], G, tactic,
                                  h=torch.full((n, 128), float("nan"), dtype=dtype))
    assert_close(h, moe_ref.moe_gate_up_int4_reference(x, sp, off, *experts[:4]), tol)
    pair_out = moe_int4.moe_down_int4(h, sp, off, *experts[4:], G, tactic,
                                      out=torch.full((n, 256), float("nan"), dtype=dtype))
    assert_close(pair_out, moe_ref.moe_down_int4_reference(h, sp, off, *experts[4:]), tol)


def test_tiles_and_dot_modes_follow_the_activation_dtype():
    """One rule for the JIT entry points and the AOT launches: 16-bit activations run INT4_TACTICS on tensor cores
    (bf16; fp16 as tf32, which holds an fp16 activation and a bf16 weight exactly), fp32 ones on FMA units at the
    FP8 kernels' FMA K step and tile bound — every tactic keeps its height. (Under the interpreter bf16 runs as
    fp32, with bf16's tiles.)"""
    from k2trt.runtime.kernels.fp8_linear import FMA_BLOCK_K, FMA_MAX_TILE
    from k2trt.runtime.aot import moe_int4 as aot_moe_int4

    assert moe_int4.int4_dot_mode(torch.float16) == moe_int4.DOT_TF32
    assert moe_int4.int4_dot_mode(torch.float32) == moe_int4.DOT_FMA
    assert moe_int4.int4_dot_mode(torch.bfloat16) == moe_int4.DOT_FMA  # the interpreter (conftest); a GPU: DOT_BF16
    for tactic, base in moe_int4.INT4_TACTICS.items():
        assert moe_int4.int4_tiles(tactic, torch.bfloat16) == moe_int4.int4_tiles(tactic, torch.float16) == base
        fp32 = moe_int4.int4_tiles(tactic, torch.float32)
        assert fp32.block_k == FMA_BLOCK_K and fp32.block_m == base.block_m
        assert fp32.block_m * fp32.block_n <= FMA_MAX_TILE
        for act, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
            for stage in ("gate_up", "down"):
                launch = aot_moe_int4.int4_gemm_launch(stage, 16, 256, 128, G, act, tactic)
                assert launch.tiles == moe_int4.int4_tiles(tactic, dtype), (stage, act, tactic)
    with pytest.raises(ValueError, match="unknown tactic 4"):
        moe_int4.int4_tiles(4, torch.bfloat16)


@pytest.mark.slow
def test_uneven_dims_and_group_sizes():
    """d and I that are no multiple of the K tile (masked tails), partial N tiles, groups of 8 and 64."""
    gen = torch.Generator().manual_seed(10)
    for group, d, inter in ((8, 200, 104), (64, 192, 128)):
        ex = (*_experts(gen, 4, inter, d, group), *_experts(gen, 4, inter, d, group), *_experts(gen, 4, d, inter, group))
        x = torch.randn(5, d, generator=gen)
        ids, w = _routing(5, 4, 2, seed=10)
        assert_close(moe_int4.moe_int4(x, ids, w, *ex, group_size=group), moe_ref.moe_int4_reference(x, ids, w, *ex))


def test_stray_indices_stay_in_bounds(experts):
    x = torch.randn(4, 256)
    n = 8
    sp = torch.tensor([3, -5, 99999, 1, 2, 0, 7, 6], dtype=torch.int32)
    off = torch.tensor([0, 3, -1, 999] + [8] * 13, dtype=torch.int32)
    h = moe_int4.moe_gate_up_int4(x, sp, off, *experts[:4], G, 1)
    moe_int4.moe_down_int4(h, sp, off, *experts[4:], G, 1)
    assert h.shape == (n, 128)


def test_shapes_are_checked(experts):
    x = torch.randn(3, 256)
    ids, w = _routing(3, 16, 2)
    with pytest.raises(ValueError, match="do not match"):
        moe_int4.moe_int4(x, ids, w, *experts, group_size=64)
    with pytest.raises(TypeError, match="int32"):
        moe_int4.moe_int4(x, ids, w, experts[0].float(), *experts[1:], group_size=G)


@pytest.mark.slow
def test_gpu_check_times_the_int4_moe_beside_the_fp8_one():
    """make gpu-check's INT4 rows, on CPU at tiny shapes: accuracy against the reference, both timings, the bytes
    INT4 experts must read (half a byte per weight, a bf16 scale per 32)."""
    from k2trt.tools import gpu_check

    rows = gpu_check.check_moe_int4([1, 5], 8, 256, 128, 2, 32, torch.device("cpu"), iters=1, warmup=0,
                                    max_check_tokens=4)
    assert [r.tokens for r in rows] == [1, 5] and rows[1].checked_tokens == 4
    assert all(r.ok and r.triton_ms > 0 and r.torch_ms > 0 for r in rows), gpu_check.format_table(rows)
    assert gpu_check.moe_int4_bytes(2, 3, 256, 128, 2, 32) == 3 * (3 * 256 * 128 // 2 + 3 * 1024 * 2) + 2 * 256 * 2
    labels = [v[0] for v in gpu_check.kernel_variants()]
    assert sum(label.startswith("moe int4") for label in labels) == 2 * len(moe_int4.INT4_TACTICS)
