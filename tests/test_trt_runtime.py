"""The TensorRT backend's glue driven through a stand-in of TensorRT's runtime (tests/trt_runtime_standin.py):
whole generations — prefill chunks in both attention forms, decode, verify steps, an EAGLE-3 draft on its own
engines — with every profile choice, input shape, address and output shape checked as TensorRT checks them, and
the weights uploaded as each engine's manifest entry prepares them."""

from __future__ import annotations

import pytest
import torch
from trt_runtime_standin import standin_backend

from k2trt.config import BLOCK_KINDS, K2Config
from k2trt.export.trt_form import engine_names
from k2trt.graphs.blocks import decompress_from
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.generation.speculation import SpeculativeConfig
from k2trt.runtime.tensorrt.profiles import ProfileSpec
from k2trt.tiny.synthetic import RandomWeights

TINY = K2Config.preset("tiny")
SPEC = ProfileSpec(max_batch=4, max_seq=512, max_prefill=256, opt_prefill=64, opt_seq=128)


@pytest.fixture(scope="module")
def trt_export(tmp_path_factory):
    """The tiny config's graphs with a Llama-layout draft (float32: the stand-in computes nothing either way)."""
    from k2trt.draft import load_draft
    from k2trt.export.exporter import export
    from k2trt.tiny.draft import make_tiny_draft

    root = tmp_path_factory.mktemp("trt-runtime")
    draft = make_tiny_draft(root / "draft", "llama")
    export(TINY, root / "onnx", "float32", log=lambda *a: None, draft=load_draft(draft, TINY))
    return root / "onnx", draft


@pytest.fixture(autouse=True)
def cpu_alignment(monkeypatch):
    """TensorRT binds 256-byte aligned addresses, which CUDA's caching allocator always gives (512-byte blocks);
    PyTorch's CPU allocator guarantees 64 (c10's gAlignment), so on the CPU the backend's check asks for that."""
    from k2trt.runtime.backends import tensorrt

    monkeypatch.setattr(tensorrt, "TENSOR_ALIGNMENT", 64)


def _scheduler(be, speculation=None, drafter=None):
    limits = Limits.resolve(TINY, be.limits, max_context=SPEC.max_seq, max_batch=SPEC.max_batch)
    return Scheduler(StageExecutor(be, TINY), TINY, limits, speculation=speculation, drafter=drafter)


def test_a_generation_runs_through_tensorrts_execution_rules(trt_export, tmp_path):
    """Prompts long enough for the decompressed form (and chunked to --max-prefill), short ones, decode and verify
    steps: every block engine of both forms, the embedding and the head are bound and enqueued without TensorRT
    refusing anything, the pool read in place."""
    from k2trt.runtime.generation.speculation import SpeedPolicy

    out, _ = trt_export
    weights = RandomWeights(TINY)
    names = engine_names(BLOCK_KINDS)
    be, engines = standin_backend(out, tmp_path / "engines", weights, SPEC, names)
    sched = _scheduler(be, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    sched.spec_policy = type("Always", (), {"allow": lambda self: True, "observe": lambda self, *a: None})()
    long = decompress_from(TINY) + 40
    reqs = [sched.submit(Request(list(range(3, 3 + n)), 12, SamplingParams())) for n in (long, 5, SPEC.max_prefill + 9)]
    sched.run_until_idle()
    assert all(len(r.token_ids) == 12 for r in reqs)
    assert sched.spec_counters.num_drafts > 0  # verify steps ran (zero logits: token 0 repeats, and is proposed)
    enqueued = {name: sum(c.enqueued for c in e.contexts) for name, e in engines.items()}
    assert all(n > 0 for n in enqueued.values()), enqueued
    assert isinstance(SpeedPolicy(), SpeedPolicy)


def test_tensorrt_refuses_what_the_profiles_do_not_hold(trt_export, tmp_path):
    """The stand-in holds the backend to the profiles: a call outside them fails where TensorRT's would."""
    from k2trt.errors import K2Error

    out, _ = trt_export
    be, _ = standin_backend(out, tmp_path / "engines", RandomWeights(TINY), SPEC, ["embedding"])
    be.embed(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(K2Error, match="exceed the engines' --max-prefill"):
        be.embed(torch.zeros(1, SPEC.max_prefill + 1, dtype=torch.int64))  # the backend's own check comes first
    be.spec = ProfileSpec(max_batch=8, max_seq=512, max_prefill=256, opt_prefill=64, opt_seq=128)  # lies about B
    with pytest.raises(RuntimeError, match="outside profile"):
        be.embed(torch.zeros(8, 1, dtype=torch.int64))


def test_an_eagle_draft_runs_on_its_engines_through_tensorrts_rules(trt_export, tmp_path):
    """The target's engines and the draft's, one generation with the draft proposing: every draft engine bound
    and enqueued, and the tokens those of the same engines without speculation."""
    from k2trt.export_manifest import read_manifest
    from k2trt.runtime.engines.builder import draft_engine_names
    from k2trt.runtime.generation.eagle import make_drafter

    out, draft = trt_export
    weights = RandomWeights(TINY)
    names = engine_names(BLOCK_KINDS) + draft_engine_names(read_manifest(out))
    spec = SpeculativeConfig(method="eagle3", model=str(draft), num_speculative_tokens=3)
    runs = {}
    for speculation in (None, spec):
        be, engines = standin_backend(out, tmp_path / "engines", weights, SPEC, names)
        drafter = make_drafter(speculation, TINY, weights, be)
        sched = _scheduler(be, speculation, drafter)
        if drafter is not None:
            assert drafter.runner.name == "tensorrt"
            sched.spec_policy = type("Always", (), {"allow": lambda self: True, "observe": lambda self, *a: None})()
        reqs = [sched.submit(Request(list(range(3, 3 + n)), 8, SamplingParams())) for n in (20, 7)]
        sched.run_until_idle()
        runs[speculation is not None] = [r.token_ids for r in reqs]
    assert runs[True] == runs[False]
    assert all(sum(c.enqueued for c in engines[n].contexts) > 0 for n in ("draft_fc", "draft_layer", "draft_head"))


def test_doctors_draft_step_passes_on_the_standin_and_fails_without_the_draft_engines(trt_export, tmp_path):
    """k2trt doctor's sixth step, as the first GPU will run it, here on the stand-in: the draft on its engines, the
    tokens of no draft; engines built without the draft are named as the failure."""
    from k2trt.errors import K2Error
    from k2trt.export_manifest import read_manifest
    from k2trt.runtime.engines.builder import draft_engine_names
    from k2trt.tools import doctor

    out, draft = trt_export
    weights = RandomWeights(TINY, seed=0)
    names = engine_names(BLOCK_KINDS) + draft_engine_names(read_manifest(out))
    be, _ = standin_backend(out, tmp_path / "engines", weights, SPEC, names)
    assert doctor.draft_tokens_agree(be, weights, draft).startswith(f"{doctor.DRAFT_TOKENS} tokens equal")
    be, _ = standin_backend(out, tmp_path / "plain", weights, SPEC, engine_names(BLOCK_KINDS))
    be.manifest.pop("draft")
    with pytest.raises(K2Error, match="not on the engines"):
        doctor.draft_tokens_agree(be, weights, draft)


def test_a_bfloat16_draft_keeps_its_caches_where_its_engines_compute(tmp_path):
    """bfloat16 engines (what a GPU runs): the draft's caches and pending aux states stay in the engines' dtype
    where they compute, the doctor's draft step passes through every binding."""
    from k2trt.draft import load_draft
    from k2trt.export.exporter import export
    from k2trt.export_manifest import read_manifest
    from k2trt.runtime.engines.builder import draft_engine_names
    from k2trt.tiny.draft import make_tiny_draft
    from k2trt.tools import doctor

    draft = make_tiny_draft(tmp_path / "draft", "llama")
    export(TINY, tmp_path / "onnx", "bfloat16", log=lambda *a: None, draft=load_draft(draft, TINY))
    weights = RandomWeights(TINY, seed=0)
    names = engine_names(BLOCK_KINDS) + draft_engine_names(read_manifest(tmp_path / "onnx"))
    be, _ = standin_backend(tmp_path / "onnx", tmp_path / "engines", weights, SPEC, names)
    assert be.act_dtype == torch.bfloat16
    runner = be.draft_runner(load_draft(draft, TINY), weights.globals(["model.embed_tokens.weight"])[
        "model.embed_tokens.weight"])
    assert (runner.device, runner.cache_dtype) == (be.device, torch.bfloat16)
    assert doctor.draft_tokens_agree(be, weights, draft).startswith(f"{doctor.DRAFT_TOKENS} tokens equal")
