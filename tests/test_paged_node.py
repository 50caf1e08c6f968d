"""The MlaPagedDecode node (graphs/contracts.py) in its three forms — the torch op (the reference), the recorded
ONNX node lowered for ONNX Runtime, and the Triton kernel that TensorRT will run — against the attention the block
graphs compute today, blocks.attend_absorbed on the gathered cache with the step's mask.

The pools are the kernel tests' (test_kernels_mla._paged): page tables out of order with holes, a shared first page,
every row no sequence holds NaN, the tables' padding naming NaN pages and wild ids — so the lowering's clamping and
its zeroing of rows past a context are checked, not assumed. Chunks are ragged (n_new below T: padding queries
must give 0), one sequence has no context at all."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from test_kernels_mla import _paged
from tolerances import TIGHT, assert_close

from k2trt.config import tiny
from k2trt.export.lower_ort import lower_for_ort
from k2trt.export.onnx_ops import OnnxOps
from k2trt.graphs import blocks, contracts
from k2trt.graphs.mask import attention_mask
from k2trt.graphs.mla_ref import paged_rows
from k2trt.graphs.ops import TorchOps
from k2trt.runtime.cache.pages import PAGE_TOKENS

CFG = tiny()
H, NOPE, ROPE, V, LAT = (CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim,
                         CFG.kv_lora_rank)
CONTEXTS, N_NEW, T = [70, 0, 129, 3], [4, 3, 1, 2], 4


def _case(seed=0):
    """(q_nope [B, H, T, nope], q_pe [B, H, T, rope], pool, tables, ctx_lens, new [B, T, L + R], n_new, wkv)."""
    _, pool, tables, ctx, _ = _paged(CONTEXTS, 1, H, LAT, ROPE, torch.float32, torch.float32, seed=seed,
                                     share=(0, 2))
    gen = torch.Generator().manual_seed(seed + 1)
    q_nope = torch.randn(len(CONTEXTS), H, T, NOPE, generator=gen)
    q_pe = torch.randn(len(CONTEXTS), H, T, ROPE, generator=gen)
    new = torch.randn(len(CONTEXTS), T, LAT + ROPE, generator=gen)
    wkv = torch.randn(H, NOPE + V, LAT, generator=gen) * LAT ** -0.5
    return q_nope, q_pe, pool, tables, ctx, new, torch.tensor(N_NEW, dtype=torch.int32), wkv


def _q_full(q_nope, q_pe, wkv):
    return torch.cat([q_nope @ wkv[:, :NOPE], q_pe], dim=-1).transpose(1, 2).contiguous()  # [B, T, H, L + R]


def _gathered_cache_and_mask(pool, tables, ctx, n_new):
    """The contexts gathered out of their pages [B, P, 576] and the step's mask, as the runtime builds them."""
    p = max(max(CONTEXTS), 1)
    cache = torch.zeros(len(CONTEXTS), p, LAT + ROPE)
    for b, n in enumerate(CONTEXTS):
        cache[b, :n] = pool[paged_rows(tables[b], n, PAGE_TOKENS)]
    key_pos = torch.cat([torch.arange(p).expand(len(CONTEXTS), -1), ctx[:, None] + torch.arange(T)], 1)
    key_valid = torch.cat([torch.arange(p)[None, :] < ctx[:, None], torch.arange(T)[None, :] < n_new[:, None]], 1)
    return cache, attention_mask(ctx[:, None] + torch.arange(T), key_pos, key_valid)


def _gathered(q_nope, q_pe, pool, tables, ctx, new, n_new, wkv):
    """What the block graphs compute today: the context gathered into [B, P, 576], a mask over it and the step's
    rows; the attended latent through W_uv ([B, T, H, v]; padding queries' rows left out by the caller)."""
    cache, mask = _gathered_cache_and_mask(pool, tables, ctx, n_new)
    o = blocks.attend_absorbed(TorchOps("float32"), CFG, q_nope, q_pe, cache, new, mask, wkv)  # [B, H, T, v]
    return o.transpose(1, 2)


def _through_w_uv(o_lat, wkv):
    return torch.einsum("bthl,hvl->bthv", o_lat, wkv[:, NOPE:])


def _ort(q_full, pool, tables, ctx, new, n_new):
    ops = OnnxOps("float32", 20)
    ins = [ops.input("q_full", "act", ["B", "T", H, LAT + ROPE]), ops.input("kv_pool", "act", ["R", LAT + ROPE]),
           ops.input("page_table", "int32", ["B", "M"]), ops.input("ctx_lens", "int32", ["B"]),
           ops.input("latent_new", "act", ["B", "T", LAT + ROPE]), ops.input("n_new", "int32", ["B"])]
    o = ops.mla_paged_decode(*ins, softmax_scale=CFG.softmax_scale, page_tokens=PAGE_TOKENS, latent_dim=LAT,
                             heads=H)
    ops.output(o, "o_lat", ["B", "T", H, LAT])
    model = ops.model("paged")
    node = next(n for n in model.graph.node if n.domain == contracts.NAMESPACE)
    assert node.op_type == contracts.MLA_PAGED_DECODE.op_type and len(node.input) == 6
    lowered = lower_for_ort(model, "float32")
    assert not [n for n in lowered.graph.node if n.domain == contracts.NAMESPACE]
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"q_full": q_full.numpy(), "kv_pool": pool.numpy(), "page_table": tables.numpy(),
            "ctx_lens": ctx.numpy(), "latent_new": new.numpy(), "n_new": n_new.numpy()}
    return torch.from_numpy(sess.run(None, feed)[0])


def test_every_form_equals_the_gathered_attention():
    q_nope, q_pe, pool, tables, ctx, new, n_new, wkv = _case()
    want = _gathered(q_nope, q_pe, pool, tables, ctx, new, n_new, wkv)
    q_full = _q_full(q_nope, q_pe, wkv)
    forms = {"torch": TorchOps("float32").mla_paged_decode(q_full, pool, tables, ctx, new, n_new, CFG.softmax_scale,
                                                            PAGE_TOKENS, LAT, H),
             "onnxruntime": _ort(q_full, pool, tables, ctx, new, n_new)}
    for name, o in forms.items():
        assert o.shape == (len(CONTEXTS), T, H, LAT), name
        assert not o.isnan().any(), f"{name} read a row no sequence holds"
        for b, n in enumerate(N_NEW):
            assert torch.equal(o[b, n:], torch.zeros_like(o[b, n:])), f"{name}: a padding query attended"
            assert_close(_through_w_uv(o, wkv)[b, :n], want[b, :n], TIGHT)


def _gathered_decompressed(q_nope, q_pe, pool, tables, ctx, new, n_new, wkv):
    """blocks.attend_decompressed on the gathered cache with the step's mask, [B, T, H, v]."""
    cache, mask = _gathered_cache_and_mask(pool, tables, ctx, n_new)
    return blocks.attend_decompressed(TorchOps("float32"), CFG, q_nope, q_pe, cache, new, mask, wkv).transpose(1, 2)


def test_the_prefill_node_in_every_form_equals_the_gathered_attention():
    """MlaPagedPrefill (decompressed): the torch op, the recorded node lowered for ONNX Runtime and the Triton
    kernel against blocks.attend_decompressed on the gathered cache."""
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    from k2trt.runtime.kernels import mla_prefill

    q_nope, q_pe, pool, tables, ctx, new, n_new, wkv = _case(seed=9)
    want = _gathered_decompressed(q_nope, q_pe, pool, tables, ctx, new, n_new, wkv)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2).contiguous()  # [B, T, H, nope + rope]
    kv_b = wkv.reshape(H * (NOPE + V), LAT)
    args = (CFG.softmax_scale, PAGE_TOKENS, LAT, H, NOPE, ROPE, V)

    ops = OnnxOps("float32", 20)
    ins = [ops.input("q", "act", ["B", "T", H, NOPE + ROPE]), ops.input("kv_pool", "act", ["R", LAT + ROPE]),
           ops.input("page_table", "int32", ["B", "M"]), ops.input("ctx_lens", "int32", ["B"]),
           ops.input("latent_new", "act", ["B", "T", LAT + ROPE]), ops.input("n_new", "int32", ["B"]),
           ops.input("kv_b", "act", [H * (NOPE + V), LAT])]
    ops.output(ops.mla_paged_prefill(*ins, *args), "o", ["B", "T", H, V])
    sess = ort.InferenceSession(lower_for_ort(ops.model("prefill"), "float32").SerializeToString(),
                                providers=["CPUExecutionProvider"])
    feed = {"q": q, "kv_pool": pool, "page_table": tables, "ctx_lens": ctx, "latent_new": new, "n_new": n_new,
            "kv_b": kv_b}
    forms = {"torch": TorchOps("float32").mla_paged_prefill(q, pool, tables, ctx, new, n_new, kv_b, *args),
             "onnxruntime": torch.from_numpy(sess.run(None, {k: v.numpy() for k, v in feed.items()})[0]),
             "kernel": mla_prefill.mla_prefill(q, pool, tables, ctx, n_new, kv_b, CFG.softmax_scale,
                                               page_tokens=PAGE_TOKENS, v_head_dim=V, latent_dim=LAT, new=new)}
    for name, o in forms.items():
        assert o.shape == (len(CONTEXTS), T, H, V), name
        assert not o.isnan().any(), f"{name} read a row no sequence holds"
        for b, n in enumerate(N_NEW):
            assert torch.equal(o[b, n:], torch.zeros_like(o[b, n:])), f"{name}: a padding query attended"
            assert_close(o[b, :n], want[b, :n], TIGHT)


def test_the_kernel_is_the_same_node():
    """The Triton kernel TensorRT's plugins will launch (runtime/kernels/mla_decode.py, the step's rows dense)
    computes the node, under the interpreter."""
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    from k2trt.runtime.kernels import mla_decode

    q_nope, q_pe, pool, tables, ctx, new, n_new, wkv = _case(seed=5)
    q_full = _q_full(q_nope, q_pe, wkv)
    node = TorchOps("float32").mla_paged_decode(q_full, pool, tables, ctx, new, n_new, CFG.softmax_scale,
                                                PAGE_TOKENS, LAT, H)
    # the tiny's latent (128) and rope (64) are powers of two, as the kernel needs
    kernel = mla_decode.mla_decode(q_full, pool, tables, ctx, CFG.softmax_scale, page_tokens=PAGE_TOKENS,
                                   latent_dim=LAT, splits=2, new=new, n_new=n_new)
    assert_close(kernel, node, TIGHT)


# ---------------------------------------------------------------------------------------------- in the block graphs

def _block_case(t=T, counts=N_NEW, seed=7):
    """A step of the tiny over a paged pool: hidden states, rope, the pool, tables and lengths, and the same
    context gathered with the step's mask (as the runtime builds them today)."""
    from k2trt.graphs.rope import rope_tables

    _, pool, tables, ctx, _ = _paged(CONTEXTS, 1, 1, LAT, ROPE, torch.float32, torch.float32, seed=seed,
                                     share=(0, 2))
    pool = pool.nan_to_num(0.0)  # the block graph's own arithmetic is not what is checked for unread rows here
    gen = torch.Generator().manual_seed(seed + 1)
    b, T = len(CONTEXTS), t
    hidden = torch.randn(b, T, CFG.hidden_size, generator=gen)
    n_new = torch.tensor(counts, dtype=torch.int32)
    cos, sin = rope_tables(CFG, ctx[:, None].long() + torch.arange(T))
    p = max(CONTEXTS)
    cache = torch.zeros(b, p, LAT + ROPE)
    for i, n in enumerate(CONTEXTS):
        cache[i, :n] = pool[paged_rows(tables[i], n, PAGE_TOKENS)]
    key_pos = torch.cat([torch.arange(p).expand(b, -1), ctx[:, None] + torch.arange(T)], 1)
    key_valid = torch.cat([torch.arange(p)[None, :] < ctx[:, None], torch.arange(T)[None, :] < n_new[:, None]], 1)
    mask = attention_mask(ctx[:, None] + torch.arange(T), key_pos, key_valid)
    return hidden, cos, sin, pool, tables, ctx, n_new, cache, mask


@pytest.mark.parametrize("layer, t, counts", [
    (0, T, N_NEW), (1, T, N_NEW),
    (1, 130, [130, 7, 128, 1]),  # past decompress_from (128 for the tiny): the MlaPagedPrefill branch
], ids=["dense_block", "moe_block", "moe_block-prefill"])
def test_a_paged_block_equals_the_gathered_block(layer, t, counts):
    """graphs/blocks.decoder_block given a PagedCache (the MlaPagedDecode node) against the same block on the
    gathered cache and its mask: the torch reference, and the paged graph export/block_graphs.py records, lowered
    for ONNX Runtime. Padding positions' outputs are not compared (nothing reads them)."""
    from k2trt.export.block_graphs import build_block_graph
    from k2trt.graphs.fp8 import WEIGHT_DEQUANT
    from k2trt.graphs.reference import ReferenceModel
    from k2trt.tiny.synthetic import RandomWeights

    kind = CFG.layer_kind(layer)
    model = ReferenceModel(RandomWeights(CFG, seed=11))
    w = model.layer_weights(layer)
    hidden, cos, sin, pool, tables, ctx, n_new, cache, mask = _block_case(t, counts)
    ops = TorchOps("float32")
    want, want_new = blocks.decoder_block(ops, CFG, kind, hidden, cos, sin, mask, cache, w, WEIGHT_DEQUANT)
    paged = blocks.PagedCache(pool, tables, ctx, n_new, PAGE_TOKENS)
    got, got_new = blocks.decoder_block(ops, CFG, kind, hidden, cos, sin, None, paged, w, WEIGHT_DEQUANT)
    assert torch.equal(got_new, want_new)
    for b, n in enumerate(counts):
        assert_close(got[b, :n], want[b, :n], TIGHT)

    graph = build_block_graph(CFG, kind, "float32", WEIGHT_DEQUANT, branches=True, paged=True,
                              page_tokens=PAGE_TOKENS)
    names = [i.name for i in graph.graph.input]
    assert "latent_cache" not in names and "attention_mask" not in names
    branches = [a.g for n in graph.graph.node if n.op_type == "If" for a in n.attribute]
    paged_nodes = sorted(n.op_type for g in branches for n in g.node if n.domain == contracts.NAMESPACE)
    assert paged_nodes == ["MlaPagedDecode", "MlaPagedPrefill"]  # both forms, chosen by T as the gathered graph
    lowered = lower_for_ort(graph, "float32")
    from k2trt.export.onnx_ops import weight_prep
    from k2trt.runtime.backends.graph_weights import graph_weights
    acts = {"hidden_states": hidden, "rope_cos": cos, "rope_sin": sin, "kv_pool": pool, "page_table": tables,
            "ctx_lens": ctx, "n_new": n_new}
    entry = {"kind": kind, "weights": [i.name for i in lowered.graph.input if i.name not in acts],
             "prep": weight_prep(lowered)}
    feed = {**acts, **graph_weights(entry, model.weights.block_weights(layer), torch.float32)}
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: np.ascontiguousarray(v.numpy()) for k, v in feed.items() if k in wanted})
    onnx_hidden = torch.from_numpy(out[0])
    for b, n in enumerate(counts):
        assert_close(onnx_hidden[b, :n], want[b, :n], 1e-5)


# ---------------------------------------------------------------------------------------------- in the runtime

def test_the_torch_backend_decodes_through_the_pool(tiny_ckpt, monkeypatch):
    """The torch reference reads pages (Backend.reads_pages): every step gets the layer's pool, page tables and
    lengths (no gather) — a 150-token prompt's prefill through MlaPagedPrefill, the rest through MlaPagedDecode;
    greedy tokens equal the same backend gathering every step, over ragged prompts whose sequences cross page
    boundaries while decoding."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.runtime.cache.pools import PagedLatentCache
    from k2trt.runtime.generation.generator import Generator

    ckpt = Checkpoint.open(tiny_ckpt)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (60, 5, 150)]
    paged_calls = []
    real = PagedLatentCache.paged
    monkeypatch.setattr(PagedLatentCache, "paged", lambda self, *a: paged_calls.append(1) or real(self, *a))
    backend = TorchBackend(ckpt)
    assert backend.reads_pages
    in_place, _ = Generator(backend, ckpt.config).generate(prompts, 12)
    assert paged_calls, "no decode step read the pool in place"
    gathering = TorchBackend(ckpt)
    gathering.reads_pages = False
    calls = len(paged_calls)
    gathered, _ = Generator(gathering, ckpt.config).generate(prompts, 12)
    assert len(paged_calls) == calls
    assert [r.token_ids for r in in_place] == [r.token_ids for r in gathered]
