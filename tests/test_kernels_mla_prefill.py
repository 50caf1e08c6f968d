"""The paged MLA prefill kernel (runtime/kernels/mla_prefill.py, decompressed form) against the dense reference of
graphs/mla_ref.py and against graphs/blocks.attend_decompressed itself, on CPU under TRITON_INTERPRET=1 (conftest).

The pools are those of the decode kernel's tests (test_kernels_mla._paged): page tables out of order with holes,
shared first pages, every row no sequence holds NaN (so "never read" is checked), tables padded with NaN pages and
wild ids. Chunks are ragged: each sequence has its own count of new positions (its last ones), the rest of the
chunk's queries are padding and must come out 0; a chunk can be a whole prompt or continue a cached context.

Tolerances: one ulp of the output dtype plus TIGHT of max|reference|. In a 16-bit math dtype two roundings differ
from the reference's fp32 arithmetic: each probability is rounded before the weighted sum (at most 2^-9 relative
in bf16, 2^-12 in fp16: that times max|v| in o), and a decompressed key or value summed in another order may round
to its neighbour (one ulp of it: at most another max|v| ulp in o, and a score moved by ulp · Σ|q_nope·k|, which
moves a probability by at most that much relative) — the bounds added to those cases, computed from the data.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from test_kernels_mla import DTYPES, FP8, _paged  # noqa: E402

# each dtype pair interprets for seconds: bf16 queries over an fp8 pool (both roundings and the scale) runs in the
# quick loop, the other pairs with the slow tests
QUICK_PAIR = (torch.bfloat16, FP8)
PAIRS = [p if p == QUICK_PAIR else pytest.param(*p, marks=pytest.mark.slow) for p in DTYPES]
from tolerances import TIGHT, assert_close, one_ulp  # noqa: E402

from k2trt.config import tiny  # noqa: E402
from k2trt.graphs import blocks  # noqa: E402
from k2trt.graphs.mask import attention_mask  # noqa: E402
from k2trt.graphs.mla_ref import paged_mla_prefill_reference, paged_rows  # noqa: E402
from k2trt.graphs.ops import TorchOps  # noqa: E402
from k2trt.runtime.cache.pages import PAGE_TOKENS  # noqa: E402
from k2trt.runtime.kernels import mla_decode  # noqa: E402
from k2trt.runtime.kernels import mla_prefill as mla  # noqa: E402

SMALL = dict(heads=4, latent=512, rope=64, nope=64, v=64)
# Kimi K2's per-head widths; the kernels run one program per head (attend) and per column block of all heads
# (decompress), so 8 heads check what 64 would, in an eighth of the interpreter's time
K2 = dict(heads=8, latent=512, rope=64, nope=128, v=128)
SOFTMAX_SCALE = 192 ** -0.5


def _case(lengths, n_new, heads, latent, rope, nope, v, q_dtype, pool_dtype, seed=0, page_tokens=PAGE_TOKENS,
          share=(3, 4)):
    """(q, pool, tables, lengths, n_new, wkv, kv_scale): _paged's pool and tables, queries [B, max n_new, H,
    nope + rope] with the padding queries random too (their output must still be 0), kv_b random."""
    pq, pool, tables, lens, kv_scale = _paged(lengths, 1, heads, latent, rope, q_dtype, pool_dtype, seed=seed,
                                              page_tokens=page_tokens, share=share)
    gen = torch.Generator().manual_seed(seed + 100)
    q = (torch.randn(len(lengths), max(n_new), heads, nope + rope, generator=gen) * 0.5).to(q_dtype)
    wkv = (torch.randn(heads * (nope + v), latent, generator=gen) * latent ** -0.5).to(q_dtype)
    return q, pool, tables, lens, torch.tensor(n_new, dtype=torch.int32), wkv, kv_scale


def _check(case, v, page_tokens=PAGE_TOKENS, new=None, **kwargs):
    q, pool, tables, lengths, n_new, wkv, kv_scale = case
    o = mla.mla_prefill(q, pool, tables, lengths, n_new, wkv, SOFTMAX_SCALE, kv_scale, page_tokens=page_tokens,
                        v_head_dim=v, new=new, **kwargs)
    ref = paged_mla_prefill_reference(q, pool, tables, lengths, n_new, wkv, SOFTMAX_SCALE, page_tokens, v,
                                      kv_scale, new=new)
    assert o.dtype == q.dtype and o.shape == ref.shape
    assert not o.isnan().any(), "the kernel read a row no sequence holds"
    for i, t in enumerate(n_new.tolist()):
        assert torch.equal(o[i, t:], torch.zeros_like(o[i, t:])), "a padding query attended"
    math = mla_decode.math_dtype(q.dtype, pool.dtype)
    tol = TIGHT
    if math != torch.float32:
        ulp = one_ulp(math)
        rows = pool.float()
        rows = rows[~rows.isnan().any(-1)] * (1.0 if kv_scale is None else kv_scale.item())
        if new is not None:
            rows = torch.cat([rows, new.float().flatten(0, 1)])
        kv = (rows[:, :wkv.shape[1]] @ wkv.float().T).abs().max().item()  # the largest key or value element
        q_nope = q[..., :q.shape[-1] - (pool.shape[-1] - wkv.shape[1])].float().abs().sum(-1).max().item()
        score_shift = ulp * q_nope * kv * SOFTMAX_SCALE  # a score moved by one ulp in every key element
        tol += (ulp / 2 + ulp + score_shift * 2) * kv / max(ref.float().abs().max().item(), 1e-30)
    assert_close(o, ref, tol)
    return o


# around page boundaries; 127 and 128 share their first page; whole prompts, chunks over a cached context, one
# new position, and padding queries in every sequence shorter than the chunk
LENGTHS = (63, 64, 130, 127, 128, 1)
NEW = (63, 10, 70, 1, 64, 1)


@pytest.mark.parametrize("q_dtype,pool_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
def test_ragged_chunks_over_pages(q_dtype, pool_dtype):
    _check(_case(LENGTHS, NEW, **SMALL, q_dtype=q_dtype, pool_dtype=pool_dtype), SMALL["v"])


def test_equals_the_block_definition():
    """The kernel computes graphs/blocks.attend_decompressed (the torch reference's prefill form) on the same
    context gathered out of the pages, at the tiny's widths in float32: the cached past, then T new positions."""
    cfg = tiny()
    h, nope, rope, vdim, lora = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                 cfg.v_head_dim, cfg.kv_lora_rank)
    past, t = [70, 3], 20
    lengths = [p + t for p in past]
    q, pool, tables, lens, n_new, wkv, _ = _case(lengths, [t, t], h, lora, rope, nope, vdim, torch.float32,
                                                  torch.float32, seed=4, share=None)
    o = mla.mla_prefill(q, pool, tables, lens, n_new, wkv, cfg.softmax_scale, page_tokens=PAGE_TOKENS,
                        v_head_dim=vdim, latent_dim=lora)
    p_max = max(past)
    cache = torch.zeros(2, p_max, lora + rope)
    new = torch.zeros(2, t, lora + rope)
    for i, n in enumerate(lengths):
        rows = pool[paged_rows(tables[i], n, PAGE_TOKENS)]
        cache[i, :past[i]] = rows[:past[i]]
        new[i] = rows[past[i]:]
    key_pos = torch.cat([torch.arange(p_max).expand(2, -1), torch.tensor(past)[:, None] + torch.arange(t)], 1)
    key_valid = torch.cat([torch.arange(p_max)[None, :] < torch.tensor(past)[:, None],
                           torch.ones(2, t, dtype=torch.bool)], 1)
    mask = attention_mask(torch.tensor(past)[:, None] + torch.arange(t), key_pos, key_valid)
    qt = q.transpose(1, 2)  # [B, H, T, nope + rope]
    ref = blocks.attend_decompressed(TorchOps("float32"), cfg, qt[..., :nope], qt[..., nope:], cache, new,
                                     mask, wkv.view(h, nope + vdim, lora))  # [B, H, T, v]
    assert_close(o, ref.transpose(1, 2), TIGHT)
    # as a block graph calls it: the past in the pool, the step's rows dense
    dense = mla.mla_prefill(q, pool, tables, torch.tensor(past, dtype=torch.int32), n_new, wkv, cfg.softmax_scale,
                            page_tokens=PAGE_TOKENS, v_head_dim=vdim, latent_dim=lora, new=new)
    assert_close(dense, ref.transpose(1, 2), TIGHT)


@pytest.mark.parametrize("q_dtype,pool_dtype", PAIRS, ids=lambda d: str(d).split(".")[-1])
def test_the_steps_rows_dense_beside_the_pool(q_dtype, pool_dtype):
    """How a block graph reads the pool in place: contexts from the pool around page boundaries (one empty: a
    whole prompt in one chunk), the chunk's rows — ragged, 5, 1, 5, 0 and 3 real — from the step's tensor, exact
    in their own dtype beside an fp8 context."""
    contexts, n_new = [63, 64, 0, 129, 1], [5, 1, 5, 0, 3]
    case = _case(contexts, n_new, **SMALL, q_dtype=q_dtype, pool_dtype=pool_dtype, seed=31)
    gen = torch.Generator().manual_seed(32)
    new = torch.randn(len(contexts), max(n_new), 576, generator=gen).to(q_dtype)
    _check(case, SMALL["v"], new=new)


@pytest.mark.parametrize("config", [
    mla.MlaPrefillConfig(block_m=16, block_n=64, decompress_p=32, decompress_n=128, decompress_k=128),
    pytest.param(mla.MlaPrefillConfig(block_m=32, block_n=16, decompress_p=32, decompress_n=32, decompress_k=128),
                 marks=pytest.mark.slow),
], ids=["m16-n64", "m32-n16"])
def test_tiles(config):
    """Query blocks smaller and larger than a chunk's, position steps of a page and of a quarter page."""
    _check(_case([130, 17], [40, 17], **SMALL, q_dtype=torch.bfloat16, pool_dtype=FP8, seed=5),
           SMALL["v"], config=config)


def test_blocks_spanning_pages():
    """16-position pages under 32- and 64-position steps: each step reads several pages through the table."""
    case = _case([47, 16, 33, 80], [47, 5, 33, 16], **SMALL, q_dtype=torch.float32, pool_dtype=torch.float32,
                 seed=6, page_tokens=16, share=(2, 3))
    _check(case, SMALL["v"], page_tokens=16)


def test_empty_entries_bounds_and_out_buffer():
    """A padded batch entry (length 0, or no new positions) gets 0; max_positions bounds what is decompressed;
    a caller's buffer (NaN-poisoned) is filled whole; bad arguments get one clear error."""
    q, pool, tables, lengths, n_new, wkv, _ = _case([40, 30, 5], [40, 4, 2], **SMALL, q_dtype=torch.float32,
                                                    pool_dtype=torch.float32, share=None)
    lengths[1] = 0
    n_new[2] = 0
    out = torch.full(q.shape[:3] + (SMALL["v"],), float("nan"))
    o = mla.mla_prefill(q, pool, tables, lengths, n_new, wkv, SOFTMAX_SCALE, page_tokens=PAGE_TOKENS,
                        v_head_dim=SMALL["v"], max_positions=64, out=out)
    assert o is out and torch.equal(o[1:], torch.zeros_like(o[1:]))
    ref = paged_mla_prefill_reference(q, pool, tables, lengths, n_new, wkv, SOFTMAX_SCALE, PAGE_TOKENS, SMALL["v"])
    assert_close(o, ref, TIGHT)
    with pytest.raises(ValueError, match="wkv must be"):
        mla.mla_prefill(q, pool, tables, lengths, n_new, wkv[1:], SOFTMAX_SCALE, page_tokens=PAGE_TOKENS,
                        v_head_dim=SMALL["v"])
    with pytest.raises(ValueError, match="kv_scale"):
        mla.mla_prefill(q, pool.to(FP8), tables, lengths, n_new, wkv, SOFTMAX_SCALE, page_tokens=PAGE_TOKENS,
                        v_head_dim=SMALL["v"])
    with pytest.raises(ValueError, match="power of two"):
        mla.mla_prefill(q[..., :-8], pool, tables, lengths, n_new, wkv[:, :], SOFTMAX_SCALE,
                        page_tokens=PAGE_TOKENS, v_head_dim=SMALL["v"])


@pytest.mark.slow
@pytest.mark.parametrize("q_dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8)],
                         ids=["bf16", "fp8"])
def test_k2_shapes(q_dtype, pool_dtype):
    """K2's widths (512 + 64 latent, nope 128, v 128; 8 of its 64 heads): a whole 65-position prompt, a chunk
    continuing a cached context across a page boundary, and a short one, two of them sharing a page."""
    _check(_case([65, 129, 128], [65, 33, 2], **K2, q_dtype=q_dtype, pool_dtype=pool_dtype, seed=11,
                 share=(1, 2)), K2["v"])
