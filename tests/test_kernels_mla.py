"""The paged MLA decode kernel (runtime/kernels/mla_decode.py) against the dense torch reference of graphs/mla_ref.py,
on CPU under TRITON_INTERPRET=1 (conftest).

Every case reads its sequences' pages where they lie: page tables out of order with holes, two sequences sharing
their first page, lengths on either side of page boundaries, Q = 1..8 new queries causal among themselves, more
splits than position blocks. Pool rows no sequence holds — spare pages, the rows past a sequence's length in its
last page, the pages its table's padding names — are NaN: a kernel that loads one puts NaN into o (a masked
probability is 0, and 0 · NaN is NaN), so "never read" is checked, not assumed.

Tolerances (tests/tolerances.py): one ulp of the output dtype plus TIGHT of max|reference| for the fp32 summation
order. Where the dots run in a 16-bit math dtype (bf16 or fp16 queries with a pool of that dtype or fp8), the
kernel rounds each probability to it before the weighted sum (as a tensor-core dot needs, and graphs/blocks.py
does): a relative error of at most 2^-9 (bf16; 2^-12 fp16) per probability, so at most that times max|c| in o —
the bound added to those cases' tolerance, computed from the data.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from tolerances import TIGHT, assert_close  # noqa: E402

from k2trt.graphs.mla_ref import paged_mla_decode_reference, paged_rows  # noqa: E402
from k2trt.runtime.cache.pages import PAGE_TOKENS  # noqa: E402
from k2trt.runtime.kernels import mla_decode as mla  # noqa: E402

FP8 = torch.float8_e4m3fn
PROB_ROUNDING = {torch.bfloat16: 2.0 ** -9, torch.float16: 2.0 ** -12, torch.float32: 0.0}
K2 = dict(heads=64, latent=512, rope=64)  # Kimi K2: 64 heads, kv_lora_rank 512, qk_rope_head_dim 64
SMALL = dict(heads=4, latent=512, rope=64)
SOFTMAX_SCALE = 192 ** -0.5  # K2's qk_head_dim (128 + 64)
BOUNDARY_LENGTHS = (63, 64, 65, 127, 128, 1)  # 127 and 128 share their first page
SPARE = 2  # pages no sequence holds: NaN, named by some tables' padding


def _paged(lengths, n_q, heads, latent, rope, q_dtype, pool_dtype, seed=0, page_tokens=PAGE_TOKENS,
           share=(3, 4)):
    """(q, pool, page_tables, lengths, kv_scale): each sequence's pages taken out of a shuffled pool (out of order,
    with holes), `share`'s second sequence reusing the first one's first page, every row no sequence holds NaN,
    and the tables padded with NaN pages and wild ids past each sequence's pages."""
    gen = torch.Generator().manual_seed(seed)
    d = latent + rope
    need = [-(-n // page_tokens) for n in lengths]
    total = sum(need) + SPARE
    order = torch.randperm(total, generator=gen).tolist()
    spare, free = order[:SPARE], order[SPARE:]
    tables = []
    for n in need:
        tables.append(free[:n])
        free = free[n:]
    if share is not None and max(share) < len(lengths) and all(lengths[i] > page_tokens for i in share):
        tables[share[1]][0] = tables[share[0]][0]  # a common full first page: the second's own is left unused
    pool = torch.full((total * page_tokens, d), float("nan"))
    for table, n in zip(tables, lengths):
        rows = torch.tensor(table, dtype=torch.long)[torch.arange(n) // page_tokens] * page_tokens + torch.arange(n) % page_tokens
        pool[rows] = torch.randn(n, d, generator=gen)
    max_pages = max(need) + 1
    pads = [spare[0], 1 << 30, -7, spare[1]]
    padded = [t + [pads[(i + j) % len(pads)] for j in range(max_pages - len(t))] for i, t in enumerate(tables)]
    kv_scale = None
    if pool_dtype == FP8:
        kv_scale = torch.tensor(0.02, dtype=torch.float32)  # N(0, 1) latents within e4m3's ±448 · 0.02
        pool = (pool / kv_scale).to(FP8)
    else:
        pool = pool.to(pool_dtype)
    q = (torch.randn(len(lengths), n_q, heads, d, generator=gen) * 2.0).to(q_dtype)  # peaked scores
    return (q, pool, torch.tensor(padded, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
            kv_scale)


def _check(case, page_tokens=PAGE_TOKENS, **kwargs):
    q, pool, tables, lengths, kv_scale = case
    o = mla.mla_decode(q, pool, tables, lengths, SOFTMAX_SCALE, kv_scale, page_tokens=page_tokens, **kwargs)
    ref = paged_mla_decode_reference(q, pool, tables, lengths, SOFTMAX_SCALE, page_tokens, kv_scale)
    assert o.dtype == q.dtype and o.shape == ref.shape
    assert not o.isnan().any(), "the kernel read a row no sequence holds"
    assert_close(o, ref, _tolerance(q, pool, kv_scale, ref))
    return o


def _tolerance(q, pool, kv_scale, ref, new=None):
    """TIGHT plus the probabilities' rounding to a 16-bit math dtype: at most PROB_ROUNDING times the largest
    latent value attended (pool rows, scaled, and the step's rows), relative to max|reference|."""
    c = pool[:, :ref.shape[-1]].float()
    c_max = c[~c.isnan()].abs().max().item() * (1.0 if kv_scale is None else kv_scale.item())
    if new is not None:
        c_max = max(c_max, new[..., :ref.shape[-1]].float().abs().max().item())
    rounding = PROB_ROUNDING[mla.math_dtype(q.dtype, pool.dtype)]
    return TIGHT + rounding * c_max / max(ref.float().abs().max().item(), 1e-30)


# ---------------------------------------------------------------------------------------------- small shapes

DTYPES = [  # (query, pool)
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, FP8),
    (torch.float32, FP8),
]


@pytest.mark.parametrize("q_dtype,pool_dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("splits", [1, 3])
def test_page_boundaries_holes_and_shared_pages(q_dtype, pool_dtype, splits):
    """Lengths 63, 64, 65, 127, 128, 1, one query each, in every pool dtype, whole and split."""
    _check(_paged(BOUNDARY_LENGTHS, 1, **SMALL, q_dtype=q_dtype, pool_dtype=pool_dtype), splits=splits)


@pytest.mark.parametrize("n_q", [2, pytest.param(5, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_new_queries_are_causal_among_themselves(n_q):
    """Speculative verify: Q new queries, query j seeing positions < len − Q + j + 1; lengths around page
    boundaries, the shortest holding only the Q new positions."""
    lengths = [max(n, n_q) for n in BOUNDARY_LENGTHS]
    _check(_paged(lengths, n_q, **SMALL, q_dtype=torch.bfloat16, pool_dtype=torch.bfloat16, seed=n_q), splits=2)


def test_queries_differ_only_in_what_they_see():
    """The same query vector at Q = 4 positions: each row equals a Q = 1 decode at the length it sees."""
    case = _paged([70, 129], 4, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32, seed=3)
    q, pool, tables, lengths, _ = case
    q = q[:, :1].expand(-1, 4, -1, -1).contiguous()
    o = _check((q, pool, tables, lengths, None), splits=2)
    for j in range(4):
        one = mla.mla_decode(q[:, j:j + 1], pool, tables, lengths - 3 + j, SOFTMAX_SCALE, splits=1,
                             page_tokens=PAGE_TOKENS)
        assert_close(o[:, j:j + 1], one, TIGHT)


@pytest.mark.parametrize("splits", [2, 7, pytest.param(16, marks=pytest.mark.slow)])
def test_more_splits_than_blocks(splits):
    """A split past a sequence's blocks is empty (max −1e30, sum 0) and weighs nothing in the merge; 16 splits of
    lengths ≤ 128 at 32 positions a block leave most of them empty."""
    _check(_paged([65, 3, 128], 3, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32, seed=splits),
           splits=splits)


def test_merge_survives_scores_far_apart():
    """One position scoring 300 for head 0 (2^433 times its neighbours), in the second of four splits: each split's
    weight must be taken relative to the largest split max (2^(m_s − M)), or it overflows fp32."""
    q, pool, tables, lengths, _ = _paged([130], 1, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32, seed=9)
    q0 = q[0, 0, 0]
    row = paged_rows(tables[0], 130, PAGE_TOKENS)[100]  # position 100: blocks of 32, splits [0, 64) [64, 128) ..
    pool[row] = q0 * (300.0 / (SOFTMAX_SCALE * q0.dot(q0)))
    o = _check((q, pool, tables, lengths, None), splits=4)
    assert_close(o[0, 0, 0], pool[row, :512], TIGHT)  # a one-hot softmax


@pytest.mark.parametrize("config", [
    mla.MlaDecodeConfig(block_m=32, block_n=64),  # one page a step, rows past Q·H masked
    mla.MlaDecodeConfig(block_m=16, block_n=16),  # a quarter page a step, and Q·H = 20 rows: two row blocks
], ids=["bm32-bn64", "bm16-bn16"])
def test_tiles(config):
    _check(_paged([130, 64, 17], 5, **SMALL, q_dtype=torch.bfloat16, pool_dtype=FP8, seed=5), splits=2,
           config=config)


def test_blocks_spanning_pages():
    """16-position pages under 32-position steps: each step reads two pages, through the table per position."""
    case = _paged([47, 16, 33, 80], 2, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32, seed=6,
                  page_tokens=16, share=(2, 3))
    _check(case, page_tokens=16, splits=2)


def test_float16_and_default_splits():
    """fp16 queries and pool, the split count chosen from the shapes (the tables' capacity: no host sync)."""
    case = _paged([100, 20], 1, **SMALL, q_dtype=torch.float16, pool_dtype=torch.float16, seed=7)
    _check(case)


def test_empty_sequence_and_out_buffer():
    """A padded batch entry (length 0) gets o = 0; a caller's buffer (NaN-poisoned) is filled whole."""
    q, pool, tables, lengths, _ = _paged([40, 1], 1, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32)
    lengths[1] = 0
    for splits in (1, 2):
        out = torch.full((2, 1, 4, 512), float("nan"))
        o = mla.mla_decode(q, pool, tables, lengths, SOFTMAX_SCALE, splits=splits, out=out, page_tokens=PAGE_TOKENS)
        assert o is out and torch.equal(o[1], torch.zeros_like(o[1]))
        assert_close(o, paged_mla_decode_reference(q, pool, tables, lengths, SOFTMAX_SCALE, PAGE_TOKENS), TIGHT)
    with pytest.raises(ValueError, match="out must be"):
        mla.mla_decode(q, pool, tables, lengths, SOFTMAX_SCALE, out=torch.empty(2, 1, 4, 576), page_tokens=PAGE_TOKENS)
    with pytest.raises(ValueError, match="kv_scale"):
        mla.mla_decode(q, pool.to(FP8), tables, lengths, SOFTMAX_SCALE, page_tokens=PAGE_TOKENS)


def test_split_count_follows_the_shapes():
    """Enough programs for two waves of an H100's SMs, never more splits than the longest sequence's blocks."""
    assert mla.num_splits(1, 4, 32_768, 32) == 64  # one long sequence: capped at MAX_SPLITS
    assert mla.num_splits(1, 4, 100, 32) == 4  # ... and at its 4 blocks
    assert mla.num_splits(64, 4, 32_768, 32) == 2
    assert mla.num_splits(256, 4, 32_768, 32) == 1  # a full batch covers the GPU alone
    assert mla.math_dtype(torch.bfloat16, FP8) == torch.bfloat16
    assert mla.math_dtype(torch.bfloat16, torch.float32) == torch.float32


# ---------------------------------------------------------------------------------------------- the step's rows dense

def _check_new(case, new, n_new, **kwargs):
    """The pool holds each sequence's context (`lengths`); the step's rows come dense in `new`, n_new[b] real."""
    q, pool, tables, lengths, kv_scale = case
    o = mla.mla_decode(q, pool, tables, lengths, SOFTMAX_SCALE, kv_scale, page_tokens=PAGE_TOKENS, new=new,
                       n_new=n_new, **kwargs)
    ref = paged_mla_decode_reference(q, pool, tables, lengths, SOFTMAX_SCALE, PAGE_TOKENS, kv_scale, new=new,
                                     n_new=n_new)
    assert not o.isnan().any(), "the kernel read a row no sequence holds"
    for b, n in enumerate(n_new.tolist()):
        assert torch.equal(o[b, n:], torch.zeros_like(o[b, n:])), "a padding query attended"
    assert_close(o, ref, _tolerance(q, pool, kv_scale, ref, new))
    return o


@pytest.mark.parametrize("q_dtype,pool_dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_steps_rows_dense_beside_the_pool(q_dtype, pool_dtype, splits):
    """How a block graph reads the pool in place: the context from the pool (around page boundaries, one sequence
    with no context at all), the step's 4 rows — ragged, 4, 1, 0 and 3 of them real — from the step's tensor, causal
    among themselves, exact in their own dtype beside an fp8 context."""
    contexts = [63, 64, 0, 129, 1]
    case = _paged(contexts, 4, **SMALL, q_dtype=q_dtype, pool_dtype=pool_dtype, seed=21)
    gen = torch.Generator().manual_seed(22)
    new = torch.randn(len(contexts), 4, 576, generator=gen).to(q_dtype)
    _check_new(case, new, torch.tensor([4, 1, 4, 0, 3], dtype=torch.int32), splits=splits)


def test_the_steps_rows_dense_equal_them_written_first():
    """Reading the step's rows from its tensor equals writing them into the pool and reading everything there."""
    q, pool, tables, lengths, _ = _paged([70, 129, 3], 3, **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32,
                                         seed=23)
    written = mla.mla_decode(q, pool, tables, lengths, SOFTMAX_SCALE, splits=2, page_tokens=PAGE_TOKENS)
    new = torch.stack([pool[paged_rows(tables[b], n, PAGE_TOKENS)[-3:]] for b, n in enumerate(lengths.tolist())])
    dense = _check_new((q, pool, tables, lengths - 3, None), new, torch.full((3,), 3, dtype=torch.int32), splits=2)
    assert_close(dense, written, TIGHT)


# ---------------------------------------------------------------------------------------------- K2's shapes

@pytest.mark.slow
@pytest.mark.parametrize("q_dtype,pool_dtype,n_q", [
    (torch.bfloat16, torch.bfloat16, 1),
    (torch.bfloat16, FP8, 4),
    (torch.float32, torch.float32, 2),
], ids=["bf16-q1", "fp8-q4", "fp32-q2"])
def test_k2_shapes(q_dtype, pool_dtype, n_q):
    """64 heads of 512 + 64: Q·H rows in row blocks, lengths around a page boundary, two of them sharing a page."""
    lengths = [max(n, n_q) for n in (65, 128, 129, 1)]
    _check(_paged(lengths, n_q, **K2, q_dtype=q_dtype, pool_dtype=pool_dtype, seed=11, share=(1, 2)), splits=3)
