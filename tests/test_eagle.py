"""EAGLE-3 drafts proposing for the verify step, in one process (graphs/eagle.py, runtime/generation/eagle.py): the
draft layer against transformers' own Llama pieces, the draft following its sequence by length (chunks, rollback,
a gap), and generation with a draft giving the tokens of generation without one — greedy and seeded, on the torch
reference and on ONNX Runtime — while its drafts are verified; what cannot run is one line. Over pipeline stages and expert-parallel ranks the aux states travel to rank 0's
draft (bit for bit, and as the tokens and the drafts kept show)."""

from __future__ import annotations

import pytest
import torch

from k2trt.config import K2Config
from k2trt.draft import load_draft
from k2trt.errors import K2Error
from k2trt.graphs import eagle
from k2trt.graphs.mask import simple_mask
from k2trt.graphs.ops import TorchOps
from k2trt.runtime.generation.eagle import EagleDrafter, make_drafter
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.generation.speculation import SpecCounters, SpeculativeConfig
from k2trt.tiny.draft import make_tiny_draft
from k2trt.tiny.synthetic import RandomWeights

TINY = K2Config.preset("tiny")


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return {form: make_tiny_draft(root / form, form) for form in ("llama", "speculators", "mla")}


def _reference_layer(cfg, w, embeds, hidden, positions, past_k, past_v):
    """The layer from transformers' Llama pieces (RMSNorm, rotary embedding, repeat_kv), causal over past + new."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb, repeat_kv

    def norm(x, name):
        n = LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        n.weight.data = w["layers.0." + name]
        return n(x)

    b, t, _ = embeds.shape
    x = torch.cat([norm(embeds, "input_layernorm.weight"), norm(hidden, "hidden_norm.weight")], dim=-1)
    lin = lambda y, name: y @ w["layers.0." + name].T  # noqa: E731
    q = lin(x, "self_attn.q_proj.weight").view(b, t, -1, cfg.head_dim).transpose(1, 2)
    k = lin(x, "self_attn.k_proj.weight").view(b, t, -1, cfg.head_dim).transpose(1, 2)
    v = lin(x, "self_attn.v_proj.weight").view(b, t, -1, cfg.head_dim).transpose(1, 2)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    ang = positions.double()[..., None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    q, k = apply_rotary_pos_emb(q, k, emb.cos().float(), emb.sin().float())
    keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    scores = q @ repeat_kv(keys, group).transpose(2, 3) * cfg.head_dim ** -0.5
    p = past_k.shape[2]
    causal = torch.arange(p + t)[None, :] <= (p + torch.arange(t))[:, None]
    o = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ repeat_kv(values, group)
    h = lin(o.transpose(1, 2).reshape(b, t, -1), "self_attn.o_proj.weight") + hidden
    m = norm(h, "post_attention_layernorm.weight")
    mlp = lin(torch.nn.functional.silu(lin(m, "mlp.gate_proj.weight")) * lin(m, "mlp.up_proj.weight"),
              "mlp.down_proj.weight")
    return mlp + h, k, v


def test_the_draft_layer_is_transformers_llama_over_embedding_and_hidden(draft_dirs):
    draft = load_draft(draft_dirs["llama"], TINY)
    cfg, w = draft.config, {k: v.float() for k, v in draft.tensors.items() if v.dtype.is_floating_point}
    g = torch.Generator().manual_seed(0)
    ops = TorchOps("float32")
    past_k = past_v = torch.zeros(1, cfg.num_key_value_heads, 0, cfg.head_dim)
    for start, n in ((0, 5), (5, 3)):  # a prefill, then positions over a cache
        embeds = torch.randn(1, n, cfg.hidden_size, generator=g)
        hidden = torch.randn(1, n, cfg.hidden_size, generator=g)
        positions = torch.arange(start, start + n)[None]
        cos, sin = eagle.rope_tables(cfg, positions)
        got = eagle.draft_layer(ops, cfg, embeds, hidden, cos, sin, simple_mask(1, start, n), past_k, past_v, w)
        want = _reference_layer(cfg, w, embeds, hidden, positions, past_k, past_v)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        past_k, past_v = torch.cat([past_k, got[1]], dim=2), torch.cat([past_v, got[2]], dim=2)


def _drafter(draft_dirs, form="llama"):
    name = "model.embed_tokens.weight"
    return EagleDrafter(load_draft(draft_dirs[form], TINY), RandomWeights(TINY).globals([name])[name], TINY)


@pytest.mark.parametrize("form", ["llama", "mla"])
def test_the_draft_follows_its_sequence_by_length(draft_dirs, form):
    """One advance over positions 0..7 equals two chunks; proposing leaves the cache at the committed positions;
    a step that starts earlier rolls the cache back; a sequence with positions it never saw proposes nothing."""
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(8, 3 * TINY.hidden_size, generator=g)
    tokens = torch.randint(0, TINY.vocab_size, (8,), generator=g).tolist()
    whole, chunks = _drafter(draft_dirs, form), _drafter(draft_dirs, form)
    whole.advance("a", 0, tokens, aux)
    chunks.advance("a", 0, tokens[:5], aux[:5])
    chunks.flush()  # computed in two chunks
    chunks.advance("a", 5, tokens[5:], aux[5:])
    assert whole.sequences["a"].length == 0 and whole.sequences["a"].total == 8  # followed, not computed yet
    whole.flush(), chunks.flush()
    torch.testing.assert_close(whole.sequences["a"].last_logits, chunks.sequences["a"].last_logits,
                               rtol=1e-4, atol=1e-4)
    first = whole.propose("a", 4)
    assert len(first) == 4 and whole.sequences["a"].length == 8 and whole.propose("a", 4) == first
    assert all(int(t) in set(load_draft(draft_dirs[form], TINY).target_ids.tolist()) for t in first)
    whole.advance("a", 3, tokens[3:6], aux[3:6])  # rejected drafts: back to 3, then 3 more
    fresh = _drafter(draft_dirs, form)
    fresh.advance("a", 0, tokens[:6], aux[:6])
    whole.flush(), fresh.flush()
    assert whole.sequences["a"].length == 6
    torch.testing.assert_close(whole.sequences["a"].last_logits, fresh.sequences["a"].last_logits,
                               rtol=1e-4, atol=1e-4)
    whole.advance("b", 4, tokens[:2], aux[:2])  # a prefix-cache hit: positions 0..3 never seen here
    assert whole.propose("b", 3) == []


class Always:
    def allow(self):
        return True

    def observe(self, seconds, tokens, speculated):
        pass


def _generate(backend, prompts, params, spec, weights, new_tokens=12):
    limits = Limits(max_context=256, max_batch=4, prefill_chunk=64)
    ex = StageExecutor(backend, TINY)
    drafter = make_drafter(spec, TINY, weights)
    sched = Scheduler(ex, TINY, limits, prefix_cache=False, speculation=spec, drafter=drafter)
    sched.spec_policy, sched.spec_counters = Always(), SpecCounters()
    reqs = [sched.submit(Request(list(p), new_tokens, params)) for p in prompts]
    sched.run_until_idle()
    return [r.token_ids for r in reqs], sched.spec_counters


@pytest.mark.parametrize("form", ["llama", pytest.param("speculators", marks=pytest.mark.slow),
                                  pytest.param("mla", marks=pytest.mark.slow)])  # ~6 s each
def test_generation_with_a_draft_gives_the_tokens_without_one(draft_dirs, form):
    """The torch reference, a ragged batch of three, greedy and seeded: the same tokens with an EAGLE-3 draft
    proposing (and its drafts verified at every decode step) as with none."""
    from k2trt.runtime.backends.torch_reference import TorchBackend

    weights = RandomWeights(TINY, seed=3)
    backend = TorchBackend(weights, "float32", 0)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dirs[form]), num_speculative_tokens=3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 30, 17)]
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=11)):
        plain, _ = _generate(backend, prompts, params, None, weights)
        fast, counters = _generate(backend, prompts, params, spec, weights)
        assert fast == plain
        assert counters.num_drafts > 0 and counters.num_draft_tokens >= counters.num_drafts


def test_onnx_runtime_with_a_draft_gives_the_tokens_without_one(draft_dirs, tiny_ckpt, tiny_export):
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.factory import BackendChoice, open_backend

    ckpt = Checkpoint.open(tiny_ckpt)
    backend = open_backend(BackendChoice("ort", tiny_export), ckpt)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dirs["llama"]), num_speculative_tokens=2)
    prompts = [list(range(5, 40)), list(range(100, 112))]
    plain, _ = _generate(backend, prompts, SamplingParams(), None, ckpt, new_tokens=10)
    fast, counters = _generate(backend, prompts, SamplingParams(), spec, ckpt, new_tokens=10)
    assert fast == plain and counters.num_drafts > 0


def test_what_cannot_run_is_one_line(draft_dirs):
    with pytest.raises(K2Error, match="needs its target's config"):
        EagleDrafter(load_draft(draft_dirs["mla"], TINY), None)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dirs["llama"]))
    from k2trt.runtime.backends.torch_reference import TorchBackend

    with pytest.raises(K2Error, match="no draft was loaded"):
        Scheduler(StageExecutor(TorchBackend(RandomWeights(TINY), "float32", 0), TINY),
                  TINY, Limits(max_context=64, max_batch=1, prefill_chunk=8), speculation=spec)


@pytest.mark.parametrize("splits", [[[0, 1, 2], [3]], [[0, 1], [2, 3]], [[0], [1, 2], [3]]],
                         ids=["3+1", "2+2", "1+2+1"])
def test_stages_carry_the_aux_states_down_to_the_last(splits):
    """A pipeline's stages each keep the residual stream entering the aux layers they hold and pass on those kept
    so far (each layer once): the last stage's aux states are one process's, bit for bit."""
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.runtime.generation.executor import carried_aux
    from k2trt.runtime.generation.step import Admit, StepPlan

    backend = TorchBackend(RandomWeights(TINY, seed=3), "float32", 0)
    aux = (1, 2, 2, 3)  # a repeated layer, and aux layers on every stage of some splits
    plan = StepPlan(first=0, tokens=[[5, 6, 7, 8, 9], [10, 11]], starts=[0, 0], sample=[True, True], rows=2,
                    capacity=16, ops=[Admit(0, SamplingParams()), Admit(1, SamplingParams())], tables=[[0], [1]])
    whole = StageExecutor(backend, TINY)
    whole.aux_layers = aux
    whole.run(plan)
    expected = whole.take_aux()
    assert expected.shape == (2, 5, len(aux) * TINY.hidden_size)
    hidden = carried = None
    for i, layers in enumerate(splits):
        stage = StageExecutor(backend, TINY, layers, first=i == 0, last=i == len(splits) - 1)
        stage.aux_layers = aux
        stage.apply(plan)
        st = stage.tensors(plan)
        hidden = stage.run_layers(plan, st, stage.embed(st) if i == 0 else hidden, carried)
        carried = stage.carry
        if not stage.last:
            width = len(carried_aux(aux, layers[-1] + 1)) * TINY.hidden_size
            assert (carried.shape[-1] if carried is not None else 0) == width
    assert torch.equal(stage.take_aux(), expected)
    assert stage.take_aux() is None  # taken once


@pytest.mark.slow
def test_a_distilled_draft_agrees_and_changes_no_token(tiny_ckpt, draft_dirs, tmp_path):
    """tools/distill_draft trains the random tiny draft on the tiny target's greedy continuations; on those prompts
    its first drafts are kept often — at most about half the time, since its vocabulary is half the target's (d2t)
    — where a random draft's are not, and the tokens stay the target's."""
    import random

    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.tools import distill_draft

    out = tmp_path / "distilled"
    assert distill_draft.main(["--model", str(tiny_ckpt), "--draft", str(draft_dirs["llama"]), "--out", str(out),
                               "--sequences", "8", "--prompt-len", "12", "--new-tokens", "24", "--steps", "80"]) == 0
    ckpt = Checkpoint.open(tiny_ckpt)
    backend = TorchBackend(ckpt, "float32", 0)
    rnd = random.Random(1)  # the tool's prompts
    prompts = [[rnd.randrange(3, TINY.vocab_size) for _ in range(12)] for _ in range(8)][:4]
    plain, _ = _generate(backend, prompts, SamplingParams(), None, ckpt, new_tokens=16)
    rates = {}
    for name, path in (("random", draft_dirs["llama"]), ("distilled", out)):
        spec = SpeculativeConfig(method="eagle3", model=str(path), num_speculative_tokens=3)
        fast, c = _generate(backend, prompts, SamplingParams(), spec, ckpt, new_tokens=16)
        assert fast == plain
        rates[name] = c.accepted_per_pos[0] / c.num_drafts if c.accepted_per_pos else 0.0
    assert rates["distilled"] > 0.25 > rates["random"], rates


@pytest.mark.slow  # ~13 s: two runs of six requests on the torch reference
def test_a_draft_under_grammars_preemption_and_continuous_batching(draft_dirs, tiny_ckpt):
    """Six requests arriving two steps apart (prefill chunks and verify steps in the same iterations), half under a
    json_schema grammar, seeded and greedy, in a pool too small for all (preemptions: the draft rolls back to 0 and
    follows the recomputed positions): the tokens of the same run without a draft, whose drafts were verified."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.runtime.text import grammar as G
    from k2trt.runtime.text.text_stream import StopRules
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    ckpt, tok = Checkpoint.open(tiny_ckpt), KimiTokenizer.from_dir(tiny_ckpt)
    schema = {"type": "object", "properties": {"host": {"type": "string", "maxLength": 8}}, "required": ["host"],
              "additionalProperties": False}
    g = G.Grammars(tok).compile(G.json_grammar(G.schema_text(schema, True, "s")))
    backend = TorchBackend(ckpt, "float32", 0)
    stops = StopRules(ids=frozenset(tok.stop_ids))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1500, (50 + 5 * i,), generator=gen).tolist() for i in range(6)]

    def run(spec):
        limits = Limits(max_context=256, max_batch=4, prefill_chunk=32, cache_pages=4)
        sched = Scheduler(StageExecutor(backend, TINY), TINY, limits, prefix_cache=False, speculation=spec,
                          drafter=make_drafter(spec, TINY, ckpt))
        sched.spec_policy, sched.spec_counters = Always(), SpecCounters()
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams()
            reqs.append(sched.submit(Request(p, 30, params, stops, grammar=g if i < 3 else None)))
            sched.iteration()
            sched.iteration()
        sched.run_until_idle()
        return [r.token_ids for r in reqs], sched

    plain, _ = run(None)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dirs["llama"]), num_speculative_tokens=3)
    fast, sched = run(spec)
    assert fast == plain
    assert sched.spec_counters.num_drafts > 0 and sched.counters.preemptions > 0


@pytest.mark.parametrize("form", ["llama", "mla"])
def test_a_batch_of_sequences_drafts_as_each_alone(draft_dirs, form):
    """advance_many and propose_many over sequences of different lengths and chunks give each sequence what it
    gets alone (the padded positions of the batch are masked, never attended)."""
    g = torch.Generator().manual_seed(4)
    lengths, asks = [3, 11, 7], [3, 1, 2]
    data = [(torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist(),
             torch.randn(n, 3 * TINY.hidden_size, generator=g)) for n in lengths]
    alone, batched = _drafter(draft_dirs, form), _drafter(draft_dirs, form)
    for key, (tokens, aux) in enumerate(data):
        alone.advance(key, 0, tokens[:2], aux[:2])
        alone.flush([key])
        alone.advance(key, 2, tokens[2:], aux[2:])
        alone.flush([key])
    batched.advance_many([(key, 0, tokens[:2], aux[:2]) for key, (tokens, aux) in enumerate(data)])
    batched.flush()
    batched.advance_many([(key, 2, tokens[2:], aux[2:]) for key, (tokens, aux) in enumerate(data)])
    batched.flush()
    for key in range(3):
        for a, b in zip(batched.sequences[key].parts, alone.sequences[key].parts):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.sequences[key].last_logits, alone.sequences[key].last_logits,
                                   rtol=1e-4, atol=1e-4)
    assert batched.propose_many([(key, k) for key, k in enumerate(asks)] + [("none", 2)]) == \
        [alone.propose(key, k) for key, k in enumerate(asks)] + [[]]


@pytest.mark.slow  # ~6 s
def test_a_prefix_hit_restores_the_drafts_cache(draft_dirs):
    """The same prompts twice through one scheduler with the prefix cache: the second time their first pages come
    from the cache, and the draft's cache over them from the pages the draft kept — keyed by the page and the token
    after it — so those requests propose drafts as well; the tokens are those of no draft, both times."""
    from k2trt.runtime.backends.torch_reference import TorchBackend

    weights = RandomWeights(TINY, seed=3)
    backend = TorchBackend(weights, "float32", 0)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 1000, (150,), generator=g).tolist() for _ in range(2)]

    def run(spec):
        limits = Limits(max_context=256, max_batch=2, prefill_chunk=64)
        sched = Scheduler(StageExecutor(backend, TINY), TINY, limits, speculation=spec,
                          drafter=make_drafter(spec, TINY, weights))
        sched.spec_policy = Always()
        rounds = []
        for _ in range(2):
            sched.spec_counters = SpecCounters()
            reqs = [sched.submit(Request(list(p), 8, SamplingParams())) for p in prompts]
            sched.run_until_idle()
            rounds.append(([r.token_ids for r in reqs], [r.cached_tokens for r in reqs], sched.spec_counters))
        return rounds, sched

    plain, _ = run(None)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dirs["llama"]), num_speculative_tokens=3)
    fast, sched = run(spec)
    (first, _, c1), (second, hits, c2) = fast
    assert first == plain[0][0] and second == plain[1][0]
    assert hits == [128, 128]  # two full pages of each prompt reused
    assert c2.num_drafts > 0 and c2.num_drafts == c1.num_drafts  # proposing as much as the first time
    assert len(sched.drafter.pages) >= 4


PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time"]


@pytest.fixture(scope="module")
def distilled_on_prompts(tiny_ckpt, draft_dirs, tmp_path_factory):
    """The random Llama draft distilled (about 7 s) on the target's greedy continuations of PROMPTS: on them its
    drafts are kept — if the aux states it reads are the target's."""
    from k2trt.tools import distill_draft

    out = tmp_path_factory.mktemp("distilled") / "draft"
    args = ["--model", str(tiny_ckpt), "--draft", str(draft_dirs["llama"]), "--out", str(out), "--new-tokens", "24",
            "--steps", "80"]
    assert distill_draft.main(args + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--pipeline", "2", "--stages", "3,1"], ["--expert-parallel", "2"],
                                    ["--pipeline", "2", "--stages", "3,1", "--expert-parallel", "2"],
                                    ["--pipeline", "2", "--stages", "3,1", "--micro-batches", "2"]],
                         ids=["2-stages", "2-ep-ranks", "2-stages-x-2-ep-ranks", "2-stages-2-micro-batches"])
def test_a_draft_over_stages_and_expert_parallel_ranks(tiny_ckpt, tiny_export, tiny_ep_exports, distilled_on_prompts,
                                                       layout):
    """The draft on rank 0 (with micro-batches, a drafter per lane), the aux states carried down the stages (layer
    2 on the first, 3 on the second) and sent from each column's last rank: the tokens of one process without a draft, and drafts kept — a draft that
    read wrong aux states would propose noise (a random draft keeps none: test_a_distilled_draft_agrees...)."""
    import contextlib
    import io
    import json
    import subprocess
    import sys

    from k2trt.cli import main

    onnx = tiny_ep_exports[2] if "--expert-parallel" in layout else tiny_export
    base = ["generate", "--model", str(tiny_ckpt), "--json", "--max-new-tokens", "16", "--temperature", "0",
            *[a for p in PROMPTS for a in ("--prompt", p)]]
    spec = ["--speculative-config", json.dumps({"method": "eagle3", "model": str(distilled_on_prompts),
                                                "num_speculative_tokens": 3})]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*base, "--onnx", str(tiny_export)]) == 0
    alone = [r["token_ids"] for r in json.loads(out.getvalue())["results"]]
    r = subprocess.run([sys.executable, "-m", "k2trt.cli", *base, "--onnx", str(onnx), *layout, *spec],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout)["results"]
    assert [x["token_ids"] for x in results] == alone
    assert results[0]["speculative"]["num_accepted_tokens"] > 0, results[0]["speculative"]



def test_the_draft_follows_without_computing_until_it_proposes(draft_dirs, monkeypatch):
    """Following a sequence only keeps its positions: the draft's layer runs when the sequence proposes (all its
    pending positions in one call, the same proposals as computing step by step), when MAX_PENDING positions
    wait, or when a page the prefix store wants fills."""
    import k2trt.runtime.generation.eagle as E

    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, TINY.vocab_size, (40,), generator=g).tolist()
    aux = torch.randn(40, 3 * TINY.hidden_size, generator=g)
    lazy, eager = _drafter(draft_dirs), _drafter(draft_dirs)
    calls = []
    real = lazy.runner.fc
    lazy.runner.fc = lambda a: calls.append(a.shape[1]) or real(a)
    for start in range(0, 12, 3):  # four steps while speculation is paused
        lazy.advance("s", start, tokens[start:start + 3], aux[start:start + 3])
        eager.advance("s", start, tokens[start:start + 3], aux[start:start + 3])
        eager.flush()
    assert calls == [] and lazy.sequences["s"].total == 12
    assert lazy.propose("s", 3) == eager.propose("s", 3) and calls == [12]
    monkeypatch.setattr(lazy, "max_pending", 8)
    lazy.advance("s", 12, tokens[12:18], aux[12:18])
    lazy.advance("s", 18, tokens[18:24], aux[18:24])  # 6 + 6 > 8: the first six are computed first
    assert calls == [12, 6] and lazy.sequences["s"].total == 24
    lazy.keep_pages("s", [b"p0", b"p1"], tokens[:25], 16)  # page 1 (positions 16..31) is not full yet
    assert calls == [12, 6] and (b"p0", tokens[16]) in lazy.pages
    lazy.advance("s", 24, tokens[24:33], aux[24:33])  # 9 > 8 pending: computed at once
    lazy.keep_pages("s", [b"p0", b"p1"], tokens[:34], 16)
    assert calls == [12, 6, 6, 9] and (b"p1", tokens[32]) in lazy.pages
    fresh = _drafter(draft_dirs)
    fresh.advance("t", 0, tokens[:20], aux[:20])
    fresh.keep_pages("t", [b"q0"], tokens[:21], 16)  # a full page the store wants, pending: computed for it
    assert fresh.sequences["t"].length == 20 and (b"q0", tokens[16]) in fresh.pages
    assert E.MAX_PENDING >= 64
