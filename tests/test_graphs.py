"""The torch reference against small hand-computed cases and against itself in its other forms.
Tolerances: float32 paths 1e-5 relative to the largest reference value; FP8 W8A8 vs W8A16 5% (e4m3 keeps
3 mantissa bits, so one element errs by up to 2^-4)."""

import dataclasses
import json
import math

import pytest
import torch

from k2trt.config import ConfigError, K2Config
from k2trt.graphs import blocks
from k2trt.graphs.fp8 import (PER_TOKEN_GROUP, WEIGHT_DEQUANT, dequant_weight, fp8_block_linear,
                              quantize_activation, quantize_weight)
from k2trt.tiny.synthetic import RandomWeights
from k2trt.graphs.mask import attention_mask, simple_mask
from k2trt.graphs.moe_ref import expert_swiglu, moe_fp8_reference
from k2trt.graphs.ops import TorchOps
from k2trt.graphs.reference import ReferenceModel, attention_expanded, greedy_generate, hf_apply_rotary
from k2trt.graphs.rope import inv_freq, rope_tables, yarn_correction_range

K2 = K2Config.preset("kimi-k2")
TINY = K2Config.preset("tiny")
OPS = TorchOps("float32")


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- config -----------------------------------------------------------------------------------------
def test_k2_config_round_trips_through_config_json(tmp_path):
    K2.write_json(tmp_path / "config.json")
    assert K2Config.from_json(tmp_path) == K2
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and raw["quantization_config"]["weight_block_size"] == [128, 128]
    assert raw["rope_scaling"]["factor"] == 32.0 and raw["routed_scaling_factor"] == 2.827


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("hidden_size"), "missing required field(s): hidden_size"),
    (lambda d: d.update(model_type="llama"), "model_type 'llama' is not supported"),
    (lambda d: d.update(num_experts_per_tok=500), "num_experts_per_tok (500) exceeds n_routed_experts (384)"),
    (lambda d: d.update(topk_method="greedy"), "topk_method 'greedy' is not supported"),
    (lambda d: d.update(num_hidden_layers="61"), "num_hidden_layers must be an integer"),
    (lambda d: d.update(hidden_size=7000), "hidden_size (7000) must be a multiple of 128"),
    (lambda d: d.update(q_lora_rank=None), "q_lora_rank null (no q LoRA) is not supported"),
])
def test_bad_config_gives_one_clear_error(tmp_path, edit, message):
    d = K2.to_hf_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=None) as e:
        K2Config.from_json(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K2Config.from_json(tmp_path)


# ---- YaRN, softmax scale, rope layout --------------------------------------------------------------
def test_yarn_table_for_k2():
    assert yarn_correction_range(K2) == (19, 20)
    base = torch.tensor([50000.0 ** (-2 * i / 64) for i in range(32)])
    f = inv_freq(K2)
    assert torch.allclose(f[:20], base[:20], rtol=1e-6)  # ramp 0: base frequency kept
    assert torch.allclose(f[20:], base[20:] / 32, rtol=1e-6)  # ramp 1: divided by the factor


def test_softmax_scale_k2():
    m = 0.1 * math.log(32) + 1
    assert abs(m - 1.34657359) < 1e-8
    assert abs(K2.softmax_scale - 192 ** -0.5 * m * m) < 1e-12
    assert abs(K2.softmax_scale - 0.13086080) < 1e-8


def test_rope_permutes_interleaved_pairs_to_halves_by_hand():
    # one head, one position, rope dim 4: pairs (a, b), (c, d) with angles t0, t1
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    t0, t1 = 0.3, 0.7
    x = torch.tensor([a, b, c, d]).view(1, 1, 1, 4)
    cos, sin = torch.tensor([[[[math.cos(t0), math.cos(t1)]]]]), torch.tensor([[[[math.sin(t0), math.sin(t1)]]]])
    out = blocks.apply_rope(OPS, x, cos, sin, 4).flatten()
    expect = torch.tensor([a * math.cos(t0) - b * math.sin(t0), c * math.cos(t1) - d * math.sin(t1),
                           b * math.cos(t0) + a * math.sin(t0), d * math.cos(t1) + c * math.sin(t1)])
    assert torch.allclose(out, expect, atol=1e-6)
    assert torch.allclose(hf_apply_rotary(x, cos, sin).flatten(), expect, atol=1e-6)


def test_rope_scores_equal_deepseek_complex_rotation():
    """HF's permuted layout and DeepSeek's interleaved complex rotation give identical q·k scores."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 5, 64, generator=g), torch.randn(1, 1, 5, 64, generator=g)
    cos, sin = rope_tables(K2, torch.arange(5).unsqueeze(0))
    ours = blocks.apply_rope(OPS, q, cos.unsqueeze(1), sin.unsqueeze(1), 64) @ \
        blocks.apply_rope(OPS, k, cos.unsqueeze(1), sin.unsqueeze(1), 64).transpose(-1, -2)
    rot = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)).unsqueeze(1)
    cq = torch.view_as_real(torch.view_as_complex(q.view(1, 1, 5, 32, 2)) * rot).flatten(-2)
    ck = torch.view_as_real(torch.view_as_complex(k.view(1, 1, 5, 32, 2)) * rot).flatten(-2)
    assert torch.allclose(ours, cq @ ck.transpose(-1, -2), atol=1e-4)


# ---- routing ---------------------------------------------------------------------------------------
def _router_case(logits, bias, **cfg_changes):
    e = logits.shape[-1]
    cfg = dataclasses.replace(TINY, n_routed_experts=e, hidden_size=e, **cfg_changes)
    w = {"mlp.gate.weight": torch.eye(e), "mlp.gate.e_score_correction_bias": torch.tensor(bias)}
    return blocks.route(OPS, cfg, logits.view(1, 1, e), w)


def test_routing_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0])
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]  # pushes expert 7 into the top-2
    ids, w = _router_case(logits, bias, num_experts_per_tok=2)
    assert sorted(ids.flatten().tolist()) == [0, 7]
    s = torch.sigmoid(logits)
    expect = torch.stack([s[0], s[7]]) / (s[0] + s[7]) * 2.827  # unbiased scores, normalized, scaled
    got = {int(i): float(v) for i, v in zip(ids.flatten(), w.flatten())}
    assert abs(got[0] - expect[0]) < 1e-6 and abs(got[7] - expect[1]) < 1e-6


def test_group_limited_routing():
    # 4 groups of 2; group score = sum of its top-2 choice scores; keep the best 2 groups
    logits = torch.tensor([3.0, -3.0, 0.0, 0.0, 2.5, 2.5, -5.0, 1.0])
    ids, _ = _router_case(logits, [0.0] * 8, num_experts_per_tok=2, n_group=4, topk_group=2)
    # group sums of sigmoid: g0 ~ 0.95+0.05=1.0, g1 = 1.0, g2 ~ 1.85, g3 ~ 0.74 -> g2 and (g0|g1)
    assert {4, 5} == set(ids.flatten().tolist())


# ---- FP8 ------------------------------------------------------------------------------------------
def test_block_dequant_with_partial_edge_blocks():
    w = torch.randn(130, 260)
    q, s = quantize_weight(w)
    assert s.shape == (2, 3)
    deq = dequant_weight(q, s)
    assert deq[129, 259] == q[129, 259].float() * s[1, 2]  # the partial corner block
    assert deq[0, 0] == q[0, 0].float() * s[0, 0]
    assert rel_err(deq, w) < 0.07


def test_w8a8_matches_deepseek_gemm_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g)
    wq, ws = quantize_weight(torch.randn(192, 256, generator=g) / 16)
    aq, as_ = quantize_activation(x)
    # C[m,n] = Σ_kb dot(A[m,kb], B[n,kb]) · a_s[m,kb] · b_s[n//128, kb], in float64 as the ground truth
    c = torch.zeros(3, 192, dtype=torch.float64)
    for kb in range(2):
        sl = slice(kb * 128, (kb + 1) * 128)
        dot = aq[:, sl].double() @ wq[:, sl].double().T
        c += dot * as_[:, kb:kb + 1].double() * ws[torch.arange(192) // 128, kb].double()
    assert rel_err(fp8_block_linear(x, wq, ws, PER_TOKEN_GROUP).double(), c) < 1e-6


def test_w8a8_within_fp8_tolerance_of_w8a16():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 512, generator=g)
    wq, ws = quantize_weight(torch.randn(320, 512, generator=g) / 20)
    a = fp8_block_linear(x, wq, ws, WEIGHT_DEQUANT)
    b = fp8_block_linear(x, wq, ws, PER_TOKEN_GROUP)
    assert 0 < rel_err(b, a) < 0.05


def test_moe_reference_equals_per_token_sum():
    g = torch.Generator().manual_seed(3)
    e, d, i, k, n = 6, 128, 128, 3, 5
    ws = [quantize_weight(torch.randn(e, *shape, generator=g) / 11) for shape in ((i, d), (i, d), (d, i))]
    x = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    wts = torch.rand(n, k, generator=g)
    y = moe_fp8_reference(x, ids, wts, *ws[0], *ws[1], *ws[2])
    for t in range(n):
        expect = sum(wts[t, j] * expert_swiglu(x[t:t + 1], ws[0][0][ids[t, j]], ws[0][1][ids[t, j]],
                                               ws[1][0][ids[t, j]], ws[1][1][ids[t, j]],
                                               ws[2][0][ids[t, j]], ws[2][1][ids[t, j]]) for j in range(k))
        assert torch.allclose(y[t], expect[0], atol=1e-5)


# ---- attention forms and the cache -----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return ReferenceModel(RandomWeights(TINY, seed=11))


def test_absorbed_attention_equals_expanded(model):
    g = torch.Generator().manual_seed(4)
    b, t = 2, 7
    x = torch.randn(b, t, TINY.hidden_size, generator=g)
    cos, sin = rope_tables(TINY, torch.arange(t).expand(b, t))
    mask = simple_mask(b, 0, t)
    w = model.layer_weights(1)
    empty = torch.zeros(b, 0, TINY.latent_dim)
    absorbed, _ = blocks.attention(OPS, TINY, "moe_block", x, cos, sin, mask, empty, w, WEIGHT_DEQUANT)
    expanded = attention_expanded(OPS, TINY, "moe_block", x, cos, sin, mask, w, WEIGHT_DEQUANT)
    assert rel_err(absorbed, expanded) < 1e-5


@pytest.mark.parametrize("cfg", [TINY, K2], ids=["tiny", "k2"])
def test_decompressed_attention_equals_absorbed(cfg):
    """The two forms of graphs/blocks.attention on the same inputs, at the model's own widths (K2: 64 heads,
    512 + 64 latent, v 128): ragged past (slots a sequence does not hold), padding queries (rows with nothing
    real after them), a past of several chunks."""
    g = torch.Generator().manual_seed(9)
    b, t, p, h = 3, 5, 37, cfg.num_attention_heads
    q_nope = torch.randn(b, h, t, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(b, h, t, cfg.qk_rope_head_dim, generator=g)
    cache = torch.randn(b, p, cfg.latent_dim, generator=g)
    new = torch.randn(b, t, cfg.latent_dim, generator=g)
    wkv = torch.randn(h, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank, generator=g) / cfg.kv_lora_rank ** 0.5
    q_pos = torch.arange(p, p + t).expand(b, t)
    k_pos = torch.arange(p + t).expand(b, p + t)
    valid = (k_pos >= 4 * torch.arange(b).unsqueeze(1)) & (k_pos < p + t - torch.arange(b).unsqueeze(1))
    mask = attention_mask(q_pos, k_pos, valid)
    absorbed = blocks.attend_absorbed(OPS, cfg, q_nope, q_pe, cache, new, mask, wkv)
    decompressed = blocks.attend_decompressed(OPS, cfg, q_nope, q_pe, cache, new, mask, wkv)
    assert absorbed.shape == (b, h, t, cfg.v_head_dim)
    assert rel_err(decompressed, absorbed) < 1e-5


def test_switch_point_follows_the_memory_and_the_multiply_adds():
    """K2: decompressed costs 256 · 512 per past position and head and saves 832 per query and position, so it
    computes less from 158 new positions at any past; it holds keys and values of 256 per context position and
    head, no more than its scores from T = 256. So from 256 new positions; below that both rules point the same way
    only where memory is the stricter (for every MLA shape: nope + v < lora + rope)."""
    k2_saved, k2_spent = blocks.decompress_costs(K2)
    assert (k2_saved, k2_spent) == (1152 - 320, 512 * 256) and -(-k2_spent // k2_saved) == 158
    assert blocks.decompress_from(K2) == 256 and blocks.decompress_from(TINY) == 128
    for cfg in (K2, TINY, dataclasses.replace(TINY, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=512)):
        saved, spent = blocks.decompress_costs(cfg)
        t = blocks.decompress_from(cfg)
        assert t == cfg.qk_nope_head_dim + cfg.v_head_dim and all(t * (p + t) * saved >= p * spent
                                                                 for p in (0, 1, 10 ** 3, 10 ** 9))


def test_attention_runs_decompressed_from_the_switch_point(model, monkeypatch):
    """The reference takes the form decompress_from names for the step's new positions, whatever the past (the forms' results agree: test_decompressed_attention_equals_absorbed)."""
    ran = []

    def spy(name):
        def form(ops, cfg, q_nope, *rest):
            ran.append(name)
            return torch.zeros(*q_nope.shape[:3], cfg.v_head_dim)
        return form

    for name in ("attend_absorbed", "attend_decompressed"):
        monkeypatch.setattr(blocks, name, spy(name))
    switch = blocks.decompress_from(TINY)
    w = model.layer_weights(0)
    for t, p in [(1, 50), (1, 0), (9, 300), (switch - 1, 0), (switch, 10 ** 5), (switch, 20), (200, 60)]:
        x = torch.randn(1, t, TINY.hidden_size)
        cos, sin = rope_tables(TINY, torch.arange(p, p + t).unsqueeze(0))
        ran.clear()
        blocks.attention(OPS, TINY, "dense_block", x, cos, sin, simple_mask(1, p, t),
                         torch.zeros(1, p, TINY.latent_dim), w, WEIGHT_DEQUANT)
        want = "attend_decompressed" if t >= switch else "attend_absorbed"
        assert ran == [want], (t, p)


def test_decoding_with_cache_equals_full_forward(model):
    prompt = [3, 14, 15, 92, 65, 35]
    new, first = greedy_generate(model, prompt, 6)
    _decodes_as_full_forward(model, prompt, new, first)


def test_long_prompt_decompressed_then_decoding_absorbed_equals_full_forward(model):
    """A prompt past the switch point: prefill decompressed, then decode absorbed over its cache."""
    prompt = torch.randint(0, 1792, (blocks.decompress_from(TINY) + 9,), generator=torch.Generator().manual_seed(2))
    new, first = greedy_generate(model, prompt.tolist(), 4)
    _decodes_as_full_forward(model, prompt.tolist(), new, first)


def _decodes_as_full_forward(model, prompt, new, first):
    full = model.forward_full(torch.tensor([prompt + new]))
    n = len(prompt)
    assert full[0, n - 1:-1].argmax(-1).tolist() == new  # each cached step chose what the full pass chooses
    assert rel_err(first, full[0, n - 1]) < 1e-5


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["rope_scaling"].update(factor="32"), "rope_scaling.factor must be a number"),
    (lambda d: d["rope_scaling"].pop("factor"), "rope_scaling needs a factor"),
    (lambda d: d.update(rope_scaling=[1]), "rope_scaling must be an object or null"),
    (lambda d: d.update(quantization_config=[1]), "quantization_config must be an object"),
    (lambda d: d["quantization_config"].update(weight_block_size="x"), "weight_block_size must be two integers"),
])
def test_bad_rope_and_quantization_config(tmp_path, edit, message):
    d = K2.to_hf_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        K2Config.from_json(tmp_path)
    assert message in str(e.value)


def test_absent_yarn_keys_take_modeling_deepseek_defaults(tmp_path):
    d = K2.to_hf_dict()
    d["rope_scaling"] = {"type": "yarn", "factor": 40.0}
    (tmp_path / "config.json").write_text(json.dumps(d))
    rs = K2Config.from_json(tmp_path).rope_scaling
    assert (rs.beta_fast, rs.beta_slow, rs.mscale, rs.mscale_all_dim, rs.original_max_position_embeddings) == \
        (32.0, 1.0, 1.0, 0.0, 4096)
    cfg = K2Config.from_json(tmp_path)
    assert cfg.softmax_scale == 192 ** -0.5  # mscale_all_dim 0: no mscale² on the softmax scale
