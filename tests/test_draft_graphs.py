"""An EAGLE-3 draft as exported graphs (export/draft_graphs.py, `k2trt export --draft`): ONNX Runtime against the
draft's math piece by piece in every layout (both MLA attention forms), the manifest naming the draft and keeping
its graphs current, and the drafter on the exported graphs proposing what the math proposes — with the tokens of no
speculation."""

from __future__ import annotations

import json

import pytest
import torch

from k2trt.config import K2Config
from k2trt.draft import load_draft
from k2trt.export.checks import FORBIDDEN
from k2trt.export.exporter import draft_graph_keys, export
from k2trt.export_manifest import read_manifest
from k2trt.graphs import eagle, rope
from k2trt.graphs.blocks import decompress_from
from k2trt.graphs.mask import attention_mask
from k2trt.runtime.backends.drafts import OrtDraftRunner, TorchDraftRunner
from k2trt.tiny.draft import make_tiny_draft
from k2trt.tiny.synthetic import RandomWeights

TINY = K2Config.preset("tiny")
TOL = 1e-4
EMBEDDING = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{form: (draft, export directory)}: the random tiny target's graphs with each form's draft."""
    root = tmp_path_factory.mktemp("draft-graphs")
    out = {}
    for form in ("llama", "mla", "speculators"):
        draft = load_draft(make_tiny_draft(root / f"draft-{form}", form), TINY)
        export(TINY, root / f"onnx-{form}", "float32", log=lambda *a: None, draft=draft)
        out[form] = (draft, root / f"onnx-{form}")
    return out


def _embedding():
    return RandomWeights(TINY).globals([EMBEDDING])[EMBEDDING]


def _close(got, ref):
    return (got - ref).abs().max().item() <= TOL * ref.abs().max().item()


@pytest.mark.parametrize("form", ["llama", "mla", "speculators"])
def test_draft_graphs_on_onnxruntime_match_the_math(exported, form):
    draft, out = exported[form]
    emb = _embedding()
    graphs = OrtDraftRunner(out, read_manifest(out), draft, emb)
    math = TorchDraftRunner(draft, emb, TINY)
    cfg, g = draft.config, torch.Generator().manual_seed(7)
    attn = cfg.attention_config(TINY) if cfg.layout == "mla" else None
    long = decompress_from(attn) if attn is not None else 9  # the MLA layer's decompressed form from here
    for b, t, p in [(1, 1, 0), (3, 1, 6), (2, 4, 5), (2, long, 0), (1, long + 3, 4)]:
        aux = torch.randn(b, t, 3 * cfg.target_hidden_size, generator=g)
        assert _close(graphs.fc(aux), math.fc(aux))
        hidden = math.fc(aux)
        ids = torch.randint(0, TINY.vocab_size, (b, t), generator=g)
        q_pos = torch.arange(p, p + t).expand(b, t)
        valid = torch.arange(p + t).expand(b, p + t) >= torch.arange(b).clamp(max=p)[:, None]  # ragged pasts
        mask = attention_mask(q_pos, torch.arange(p + t).expand(b, p + t), valid)
        if attn is not None:
            cos, sin = rope.rope_tables(attn, q_pos)
            parts = [torch.randn(b, p, attn.latent_dim, generator=g)]
        else:
            cos, sin = eagle.rope_tables(cfg, q_pos)
            parts = [torch.randn(b, cfg.num_key_value_heads, p, cfg.head_dim, generator=g) for _ in range(2)]
        got, ref = graphs.layer(ids, hidden, cos, sin, mask, parts), math.layer(ids, hidden, cos, sin, mask, parts)
        assert _close(got[0], ref[0]) and all(_close(x, y) for x, y in zip(got[1], ref[1])), (b, t, p)
        assert _close(graphs.head(ref[0]), math.head(ref[0]))


def test_the_manifest_names_the_draft_and_keeps_its_graphs_current(exported, tmp_path):
    import onnx

    draft, _ = exported["mla"]
    out = tmp_path / "onnx"
    export(TINY, out, "float32", log=lambda *a: None, draft=draft)
    m = read_manifest(out)
    assert m["draft"] == {"fingerprint": draft.config.fingerprint(), "layout": "mla",
                          "aux_layer_ids": list(draft.config.aux_layer_ids)}
    keys = draft_graph_keys(draft.config)
    assert "trt/draft_layer.prefill" in keys and all(k in m["graphs"] for k in keys)
    for key in (k for k in keys if k.startswith("trt/")):  # TensorRT's forms: one attention form each, no If
        model = onnx.load(str(out / m["graphs"][key]["file"]))
        assert not {n.op_type for n in model.graph.node} & FORBIDDEN, key
    assert m["graphs"]["ort/draft_layer"]["weights"][0] == "embed_tokens.weight"  # the target's, shared
    lines = []
    export(TINY, out, "float32", log=lines.append, draft=draft)
    assert "draft (mla layout): up to date" in lines
    other, _ = exported["llama"]  # another draft replaces it
    export(TINY, out, "float32", log=lines.append, draft=other)
    m = read_manifest(out)
    assert m["draft"]["layout"] == "llama" and "trt/draft_layer.prefill" not in m["graphs"]
    export(TINY, out, "float32", log=lines.append)  # and an export without one drops it
    m = read_manifest(out)
    assert "draft" not in m and not any("draft" in k for k in m["graphs"])
    json.dumps(m)


@pytest.mark.parametrize("form", ["llama", "mla"])
def test_the_drafter_on_exported_graphs_proposes_what_the_math_proposes(exported, form):
    from k2trt.runtime.generation.eagle import EagleDrafter

    draft, out = exported[form]
    emb = _embedding()
    on_graphs = EagleDrafter(draft, emb, TINY, OrtDraftRunner(out, read_manifest(out), draft, emb))
    on_math = EagleDrafter(draft, emb, TINY)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(3, 1000, (n,), generator=g).tolist(), torch.randn(n, 3 * TINY.hidden_size, generator=g))
            for n in (5, 12)]
    for drafter in (on_graphs, on_math):
        drafter.advance_many([(key, 0, tokens, aux) for key, (tokens, aux) in enumerate(data)])
    assert on_graphs.propose_many([(0, 3), (1, 3)]) == on_math.propose_many([(0, 3), (1, 3)])


@pytest.mark.slow  # ~2 s: two generations of each sampling
def test_generation_on_exported_draft_graphs_gives_the_tokens_without_one(exported):
    """The ONNX Runtime target on an export holding the draft: make_drafter runs the draft's graphs, and greedy
    and seeded tokens are those of no speculation."""
    from k2trt.runtime.backends.ort import OrtBackend
    from k2trt.runtime.generation.eagle import make_drafter
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.sampling import SamplingParams
    from k2trt.runtime.generation.scheduler import Request, Scheduler
    from k2trt.runtime.generation.speculation import SpecCounters, SpeculativeConfig

    draft, out = exported["llama"]
    weights = RandomWeights(TINY)
    backend = OrtBackend(out, weights)
    spec = SpeculativeConfig(method="eagle3", model=str(draft.root), num_speculative_tokens=2)

    class Always:
        def allow(self):
            return True

        def observe(self, seconds, tokens, speculated):
            pass

    def run(speculation, params):
        drafter = make_drafter(speculation, TINY, weights, backend)
        if speculation is not None:
            assert drafter.runner.name == "onnxruntime"
        sched = Scheduler(StageExecutor(backend, TINY), TINY, Limits(max_context=128, max_batch=2, prefill_chunk=32),
                          prefix_cache=False, speculation=speculation, drafter=drafter)
        sched.spec_policy, sched.spec_counters = Always(), SpecCounters()
        reqs = [sched.submit(Request(list(p), 10, params)) for p in ([5, 6, 7, 8, 9, 10], list(range(40, 57)))]
        sched.run_until_idle()
        return [r.token_ids for r in reqs], sched.spec_counters

    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
        plain, _ = run(None, params)
        fast, counters = run(spec, params)
        assert fast == plain and counters.num_drafts > 0


@pytest.mark.slow  # ~2 s: an export and three CLI runs
def test_export_and_generate_with_a_draft_from_the_command_line(tiny_ckpt, tmp_path, capsys):
    """`k2trt export --draft DIR`, then `generate --speculative-config eagle3` on those graphs: the draft runs on
    them (--json says where) and the text is that of no speculation; a draft that is not one is one line."""
    from k2trt.cli import main

    draft = make_tiny_draft(tmp_path / "draft", "mla")
    out = tmp_path / "onnx"
    assert main(["export", "--model", str(tiny_ckpt), "--out", str(out), "--draft", str(draft)]) == 0
    base = ["generate", "--model", str(tiny_ckpt), "--onnx", str(out), "--json", "--max-new-tokens", "8",
            "--prompt", "The quick brown fox"]
    capsys.readouterr()
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2})
    assert main([*base, "--speculative-config", spec]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["token_ids"] == plain["token_ids"] and fast["speculative"]["draft_runs_on"] == "onnxruntime"
    assert main(["export", "--model", str(tiny_ckpt), "--out", str(out), "--draft", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err


# ---- the draft's TensorRT engines --------------------------------------------------------------------------

class _GraphAsEngine:
    """A draft engine as TensorRT runs it, computing with the trt/ graph it is built from (float32, no plugins) on
    ONNX Runtime, and checking each call as TensorRT does: IExecutionContext::setInputShape refuses a shape outside
    the selected optimization profile's [min, max] (NvInferRuntime.h; the profile is the runtime's choice by T,
    profiles.profile_index), enqueue needs an address for every input (NvInferRuntime.h: "all input tensors ...
    must have their addresses set"), and an input of another dtype than the engine's is no tensor of it."""

    def __init__(self, entry: dict, path, calls: list):
        import onnxruntime as ort

        from k2trt.dtypes import torch_dtype

        self.entry, self.calls = entry, calls
        self.dtypes = {i["name"]: torch_dtype(i["dtype"]) for i in entry["inputs"] + entry["outputs"]}
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(self, t: int, inputs: dict, weights: dict, outputs: dict) -> None:
        from k2trt.runtime.tensorrt.profiles import Profile, profile_index

        profile = Profile.from_dict(self.entry["profiles"][profile_index(t)])
        for name, x in inputs.items():
            r = profile.shapes.get(name)
            if r is not None and not all(lo <= d <= hi for lo, d, hi in zip(r.min, x.shape, r.max)):
                raise RuntimeError(f"setInputShape({name}, {tuple(x.shape)}) outside [{r.min}, {r.max}]")
            if x.dtype != self.dtypes[name]:
                raise RuntimeError(f"{name} is {x.dtype}, the engine takes {self.dtypes[name]}")
        unbound = {i["name"] for i in self.entry["inputs"]} - set(inputs) - set(weights)
        if unbound:
            raise RuntimeError(f"enqueue with no address for {sorted(unbound)}")
        self.calls.append(self.entry["kind"] + (".prefill" if self.entry["file"].endswith(".prefill.engine")
                                                else ""))
        feeds = {n: v.contiguous().numpy() for n, v in {**inputs, **weights}.items()}
        for o, value in zip(self.entry["outputs"], self.session.run(None, feeds)):
            out = outputs[o["name"]]
            assert tuple(out.shape) == value.shape, (o["name"], tuple(out.shape), value.shape)
            out.copy_(torch.from_numpy(value))


def _trt_backend(out, calls):
    """A TrtBackend over the draft's engines as `k2trt build` records them (engine manifest entries, profiles of a
    small spec), each a _GraphAsEngine; its other parts need no GPU."""
    from k2trt.runtime.backends.tensorrt import TrtBackend
    from k2trt.runtime.engines.builder import draft_engine_names
    from k2trt.runtime.tensorrt import engine_manifest as EM
    from k2trt.runtime.tensorrt.profiles import ProfileSpec, graph_profiles

    export_m = read_manifest(out)
    be = TrtBackend.__new__(TrtBackend)
    be.spec = ProfileSpec(max_batch=4, max_seq=256, max_prefill=128, opt_prefill=64, opt_seq=128)
    be.device, be.act_dtype, be.cfg = torch.device("cpu"), torch.float32, TINY
    be.engines = {}
    for name in draft_engine_names(export_m):
        graph = export_m["graphs"][f"trt/{name}"]
        entry = EM.engine_entry(name.split(".")[0], graph, graph_profiles(be.spec, graph), f"{name}.engine",
                                "0" * 64, {})
        be.engines[name] = _GraphAsEngine(entry, out / graph["file"], calls)
    be.manifest = {"draft": export_m["draft"], "engines": {k: e.entry for k, e in be.engines.items()}}
    be._run = lambda engine, t, inputs, weights, outputs: be.engines[engine].run(t, inputs, weights, outputs)
    return be


@pytest.mark.parametrize("form", ["llama", "mla"])
def test_the_drafter_on_tensorrt_engines_proposes_what_the_math_proposes(exported, form):
    """The draft's engines through TrtDraftRunner: within their profiles (a first advance has no past: one masked
    slot, since P starts at 1), the MLA layer's decompressed engine for a long chunk, and the proposals of the
    draft's math."""
    from k2trt.runtime.generation.eagle import EagleDrafter

    draft, out = exported[form]
    emb = _embedding()
    calls = []
    be = _trt_backend(out, calls)
    runner = be.draft_runner(draft, emb)
    assert runner.name == "tensorrt"
    on_engines, on_math = EagleDrafter(draft, emb, TINY, runner), EagleDrafter(draft, emb, TINY)
    g = torch.Generator().manual_seed(4)
    long = decompress_from(draft.config.attention_config(TINY)) if form == "mla" else 20
    data = [(torch.randint(3, 1000, (n,), generator=g).tolist(), torch.randn(n, 3 * TINY.hidden_size, generator=g))
            for n in (6, long + 2)]
    for drafter in (on_engines, on_math):
        drafter.advance_many([(key, 0, tokens[:-2], aux[:-2]) for key, (tokens, aux) in enumerate(data)])
        drafter.advance_many([(key, len(tokens) - 2, tokens[-2:], aux[-2:]) for key, (tokens, aux) in enumerate(data)])
    assert on_engines.propose_many([(0, 3), (1, 3)]) == on_math.propose_many([(0, 3), (1, 3)])
    assert ("draft_layer.prefill" in calls) == (form == "mla")
    with pytest.raises(RuntimeError, match="outside"):  # what the padding slot avoids
        be.engines["draft_layer"].run(2, {"past_k" if form == "llama" else "latent_cache":
                                          torch.zeros(1, 0) if form == "mla" else torch.zeros(1, 2, 0, 8)}, {}, {})


def test_engines_without_the_draft_run_it_on_its_math_and_a_stale_one_is_refused(exported):
    from k2trt.errors import K2Error
    from k2trt.runtime.backends.drafts import draft_weights
    from k2trt.runtime.backends.tensorrt_draft import TrtDraftRunner
    from k2trt.runtime.generation.eagle import EagleDrafter

    draft, out = exported["llama"]
    be = _trt_backend(out, [])
    be.manifest = {"engines": be.manifest["engines"]}  # built from an export without --draft
    assert be.draft_runner(draft, _embedding()) is None
    assert EagleDrafter(draft, _embedding(), TINY, None).runner.name == "torch"  # the drafter computes its math
    del be.engines["draft_head"]
    with pytest.raises(K2Error, match="no draft_head"):
        TrtDraftRunner(be, draft, draft_weights(draft, _embedding()), TINY)
