"""The paged MLA attention kernels in `make gpu-check` (k2trt/tools/gpu_check.py), at Kimi K2's attention shapes.

  * decode (runtime/kernels/mla_decode.py: absorbed, the pool read in place through the page tables, split over
    the context) against the path the block graphs take today: the step's pages gathered into one buffer
    (PagedLatentCache.gather's index_select) and dense absorbed attention in torch — at B ∈ {1, 8, 64} sequences of
    P ∈ {1k, 8k, 32k} positions. TB/s counts the bytes decode must read: every held row once, the queries, the
    output; `bandwidth_share` sets it against the GPU's peak (the goal: ≥ 70 % at 8 × 32k);
  * prefill (runtime/kernels/mla_prefill.py: decompressed) for a chunk over a cached context against the gather,
    the decompression by kv_b in torch and torch's scaled_dot_product_attention; TFLOP/s counts the
    decompression's and the causal attention's multiply-adds.

Accuracy is checked against graphs/mla_ref.py's dense references on the first sequences (they loop in Python).
The measuring code is device-agnostic: tests/test_kernels.py runs it on CPU at tiny shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2trt.graphs.fp8 import cdiv
from k2trt.graphs.mla_ref import paged_mla_decode_reference, paged_mla_prefill_reference

PAGE = 64  # runtime/cache/pages.PAGE_TOKENS
# peak memory bandwidth by device name (NVIDIA's datasheets): the share the decode rows report
PEAK_TBS = {"H200": 4.8, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35}


def mla_decode_bytes(batch: int, positions: int, n_q: int, heads: int, latent: int, rope: int, pool_bytes: int,
                     act_bytes: int) -> int:
    """Every held pool row once, the page tables, the queries [Q, H, L + R] and the output [Q, H, L]."""
    per_seq = (positions * (latent + rope) * pool_bytes + cdiv(positions, PAGE) * 4
               + n_q * heads * (2 * latent + rope) * act_bytes)
    return batch * per_seq


def mla_decode_flops(batch: int, positions: int, n_q: int, heads: int, latent: int, rope: int) -> int:
    """Scores over L + R, the weighted sum over L, per query row and position."""
    return 2 * batch * n_q * heads * positions * (2 * latent + rope)


def mla_prefill_flops(batch: int, context: int, chunk: int, heads: int, latent: int, nope: int, rope: int,
                      v: int) -> int:
    """kv_b over every position of context and chunk, then causal attention: query j of the chunk sees
    context + j + 1 positions."""
    total = context + chunk
    decompress = 2 * batch * total * heads * (nope + v) * latent
    seen = chunk * context + chunk * (chunk + 1) // 2
    return decompress + 2 * batch * heads * seen * (nope + rope + v)


def bandwidth_share(tbs: float, gpu: str) -> float | None:
    """tbs as a share of the GPU's peak memory bandwidth, when its name is one PEAK_TBS knows."""
    for name, peak in PEAK_TBS.items():  # the longer names first: "H100 PCIe" before "H100"
        if name in gpu:
            return tbs / peak
    return None


def paged_pool(batch: int, positions: int, width: int, dtype, device, gen) -> tuple:
    """(pool, page_tables, lengths): every sequence `positions` long, its pages dealt out of a shuffled pool."""
    pages = cdiv(positions, PAGE)
    order = torch.randperm(batch * pages, generator=gen, device=device)
    tables = order.view(batch, pages).to(torch.int32)
    pool = torch.randn(batch * pages * PAGE, width, generator=gen, device=device).to(dtype)
    return pool, tables, torch.full((batch,), positions, dtype=torch.int32, device=device)


def gathered(pool, tables, positions: int):
    """Today's per-layer copy: the sequences' rows in position order, [B, P, width]."""
    pos = torch.arange(positions, device=pool.device)
    rows = tables.long()[:, pos // PAGE] * PAGE + pos % PAGE
    return pool.index_select(0, rows.reshape(-1)).view(*rows.shape, pool.shape[-1])


def torch_decode(q, pool, tables, positions: int, scale: float, latent: int):
    """Gather, then dense absorbed attention (one query per sequence: nothing causal)."""
    cache = gathered(pool, tables, positions)
    s = torch.einsum("bqhd,bpd->bqhp", q, cache).float() * scale
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.einsum("bqhp,bpl->bqhl", p, cache[..., :latent])


def torch_prefill(q, pool, tables, context: int, new, wkv, scale: float, latent: int, nope: int, v: int):
    """Gather the context, decompress context and chunk through kv_b, then torch's SDPA with the chunk's causal
    offset. q [B, T, H, nope + rope], new [B, T, L + R]."""
    b, t, h, _ = q.shape
    rows = torch.cat([gathered(pool, tables, context), new], dim=1)  # [B, P + T, L + R]
    kv = (rows[..., :latent] @ wkv.T).view(b, -1, h, nope + v)
    k = torch.cat([kv[..., :nope], rows[..., None, latent:].expand(-1, -1, h, -1)], dim=-1)
    visible = torch.arange(context + t, device=q.device)[None, :] <= context + torch.arange(t, device=q.device)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                       attn_mask=visible, scale=scale)
    return o.transpose(1, 2)


def check_mla_decode(batches, positions_list, device, heads: int = 64, latent: int = 512, rope: int = 64,
                     dtype=torch.bfloat16, max_check: int = 2, iters: int = 10, warmup: int = 2, seed: int = 2,
                     log=None) -> list:
    from k2trt.runtime.kernels.mla_decode import mla_decode
    from k2trt.tools.gpu_check import Row, _err, time_ms

    gen = torch.Generator(device=device).manual_seed(seed)
    scale = (128 + rope) ** -0.5
    rows = []
    for p in positions_list:
        for b in batches:
            pool, tables, lengths = paged_pool(b, p, latent + rope, dtype, device, gen)
            q = torch.randn(b, 1, heads, latent + rope, generator=gen, device=device).to(dtype)
            o = mla_decode(q, pool, tables, lengths, scale, page_tokens=PAGE, latent_dim=latent)
            c = min(b, max_check)  # sequences are independent: the first few are a valid check
            max_abs, rel = _err(o[:c], paged_mla_decode_reference(q[:c], pool, tables[:c], lengths[:c], scale, PAGE,
                                                                   latent_dim=latent))
            tri = time_ms(lambda: mla_decode(q, pool, tables, lengths, scale, page_tokens=PAGE, latent_dim=latent),
                          device, warmup, iters)
            tor = time_ms(lambda: torch_decode(q, pool, tables, p, scale, latent), device, min(warmup, 1), iters)
            rows.append(Row(f"mla decode paged B{b} P{p}", b, max_abs, rel, tri, tor,
                            mla_decode_bytes(b, p, 1, heads, latent, rope, pool.element_size(), q.element_size()),
                            mla_decode_flops(b, p, 1, heads, latent, rope), c))
            del pool, tables, q, o
            if log:
                log(rows[-1])
    return rows


def check_mla_prefill(cases, device, heads: int = 64, latent: int = 512, nope: int = 128, rope: int = 64,
                      v: int = 128, dtype=torch.bfloat16, iters: int = 5, warmup: int = 1, seed: int = 3,
                      log=None) -> list:
    """cases: (batch, context, chunk) — the context in the pool, the chunk's rows dense (as a block passes them)."""
    from k2trt.runtime.kernels.mla_prefill import mla_prefill
    from k2trt.tools.gpu_check import Row, _err, time_ms

    gen = torch.Generator(device=device).manual_seed(seed)
    scale = (nope + rope) ** -0.5
    rows = []
    for b, context, chunk in cases:
        pool, tables, ctx = paged_pool(b, max(context, 1), latent + rope, dtype, device, gen)
        ctx.fill_(context)
        q = torch.randn(b, chunk, heads, nope + rope, generator=gen, device=device).to(dtype)
        new = torch.randn(b, chunk, latent + rope, generator=gen, device=device).to(dtype)
        wkv = (torch.randn(heads * (nope + v), latent, generator=gen, device=device) * latent ** -0.5).to(dtype)
        n_new = torch.full((b,), chunk, dtype=torch.int32, device=device)

        def kernel():
            return mla_prefill(q, pool, tables, ctx, n_new, wkv, scale, page_tokens=PAGE, v_head_dim=v,
                               latent_dim=latent, max_positions=context, new=new)

        o = kernel()
        ref = paged_mla_prefill_reference(q[:1], pool, tables[:1], ctx[:1], n_new[:1], wkv, scale, PAGE, v,
                                          latent_dim=latent, new=new[:1])
        max_abs, rel = _err(o[:1], ref)
        tri = time_ms(kernel, device, warmup, iters)
        tor = time_ms(lambda: torch_prefill(q, pool, tables, context, new, wkv, scale, latent, nope, v), device,
                      warmup, iters)
        rows_read = context * (latent + rope) * pool.element_size() + chunk * (latent + rope) * new.element_size()
        bytes_read = b * rows_read + wkv.numel() * wkv.element_size()
        rows.append(Row(f"mla prefill paged B{b} ctx{context} T{chunk}", b * chunk, max_abs, rel, tri, tor,
                        bytes_read, mla_prefill_flops(b, context, chunk, heads, latent, nope, rope, v), chunk))
        del pool, q, new, o
        if log:
            log(rows[-1])
    return rows


def bandwidth_lines(rows, gpu: str) -> list[str]:
    """For each decode row: its TB/s as a share of the GPU's peak, when the GPU is one PEAK_TBS knows."""
    out = []
    for r in rows:
        if r.name.startswith("mla decode"):
            tbs = r.bytes / max(r.triton_ms, 1e-9) / 1e9
            share = bandwidth_share(tbs, gpu)
            if share is not None:
                out.append(f"{r.name}: {tbs:.2f} TB/s, {share:.0%} of {gpu}'s peak")
    return out
