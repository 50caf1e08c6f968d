"""EAGLE-3 drafts as published (k2trt/draft.py): the three forms make-tiny writes load into one form, the aux-id
conventions normalize to "the residual stream entering layer i", a draft resolves from the Hugging Face cache, and
every damaged or unsupported draft is one line naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from k2trt.cli import main
from k2trt.config import K2Config
from k2trt.draft import load_draft
from k2trt.draft_config import LAYER, DraftError, parse_draft_config
from k2trt.safetensors_io import load_file, save_file
from k2trt.tiny.draft import DRAFT_FORMATS, make_tiny_draft, tiny_draft_config

TINY = K2Config.preset("tiny")
K2 = K2Config.preset("kimi-k2")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {form: make_tiny_draft(root / form, form) for form in DRAFT_FORMATS}


@pytest.mark.parametrize("form", DRAFT_FORMATS)
def test_each_published_form_loads_into_one_form(drafts, form):
    draft = load_draft(drafts[form], TINY)
    assert draft.config == tiny_draft_config(TINY, form)[0]
    assert set(draft.config.tensor_shapes()) <= set(draft.tensors)
    assert not any(n.startswith("midlayer.") for n in draft.tensors)  # AQ-MedAI's spelling, normalized
    ids = draft.target_ids
    assert ids.shape == (draft.config.draft_vocab_size,) and ids.dtype == torch.int64
    assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < TINY.vocab_size
    assert draft.shares_embedding == (form != "mla")  # the MLA draft ships its own embedding
    assert draft.config.aux_layer_ids == (2, 2, 3)  # entering layers 2, 2 and 3 of the tiny's 4, in every form
    assert draft.config.aux_ids_as_written == ((1, 1, 2) if form == "speculators" else (2, 2, 3))


def test_the_llama_draft_stores_the_layer_as_midlayer(drafts):
    stored = load_file(drafts["llama"] / "model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in stored and not any(n.startswith(LAYER) for n in stored)
    q = stored["midlayer.self_attn.q_proj.weight"]
    assert q.shape[1] == 2 * TINY.hidden_size  # concat(embedding, hidden): the first projections read 2 × hidden


def _k2_llama(**changes) -> dict:
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168, "intermediate_size": 18432,
           "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 163840, "draft_vocab_size": 32000,
           "rms_norm_eps": 1e-5, "rope_theta": 50000.0}
    return {**raw, **changes}


@pytest.mark.parametrize("written, normalized", [
    ([2, 30, 58], (2, 30, 58)),  # inputs to layers (vLLM, AQ-MedAI)
    ([1, 29, 57], (2, 30, 58)),  # outputs of layers (TensorRT-LLM's convention): the same tensors
    (None, (2, 30, 58)),  # absent: vLLM's default for 61 layers, (2, n // 2, n - 3)
])
def test_the_aux_id_conventions_name_the_same_tensors(written, normalized):
    raw = _k2_llama(**({} if written is None else {"eagle_aux_hidden_state_layer_ids": written}))
    cfg = parse_draft_config(raw, "config.json", K2)
    assert cfg.aux_layer_ids == normalized
    assert cfg.aux_ids_as_written == (None if written is None else tuple(written))
    assert cfg.head_dim == 7168 // 64 and cfg.tensor_shapes()["fc.weight"] == (7168, 3 * 7168)
    assert cfg.tensor_shapes()[LAYER + "self_attn.q_proj.weight"] == (64 * 112, 2 * 7168)
    nested = parse_draft_config({**_k2_llama(), "eagle_config": {"eagle_aux_hidden_state_layer_ids": written or
                                                                 [2, 30, 58]}}, "config.json", K2)
    assert nested.aux_layer_ids == normalized  # ModelOpt's spelling, in eagle_config


def test_the_mla_draft_of_k2_has_k2s_attention_shapes():
    raw = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
           "num_attention_heads": 64, "vocab_size": 163840, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
    cfg = parse_draft_config(raw, "config.json", K2)
    shapes = cfg.tensor_shapes()
    assert cfg.layout == "mla" and cfg.draft_vocab_size == 163840  # the full vocabulary: no d2t
    assert shapes[LAYER + "self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes[LAYER + "self_attn.kv_a_proj_with_mqa.weight"] == (576, 2 * 7168)
    assert shapes[LAYER + "self_attn.kv_b_proj.weight"] == (64 * 256, 512)


def _rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def _config(path, change):
    raw = json.loads((path / "config.json").read_text())
    change(raw)
    (path / "config.json").write_text(json.dumps(raw))


DAMAGE = [
    (lambda p: _rewrite(p, lambda t: t.pop("midlayer.mlp.up_proj.weight")), "layers.0.mlp.up_proj.weight is missing"),
    (lambda p: _rewrite(p, lambda t: t.update({"fc.weight": t["fc.weight"][:, :-1].contiguous()})),
     r"fc.weight is \[128, 383\], the config says \[128, 384\]"),
    (lambda p: _rewrite(p, lambda t: t.update({"d2t": t["d2t"] + 10**6})), "d2t maps draft ids outside"),
    (lambda p: _rewrite(p, lambda t: t.update({"d2t": torch.zeros_like(t["d2t"]) - torch.arange(t["d2t"].numel())})),
     "d2t maps two draft ids to the same target id"),
    (lambda p: _rewrite(p, lambda t: t.pop("d2t")), "no d2t, but draft_vocab_size"),
    (lambda p: _rewrite(p, lambda t: t.update({"midlayer.mlp.up_proj.weight_scale_inv": torch.ones(1)})),
     "is a quantized tensor"),
    (lambda p: _config(p, lambda c: c.pop("hidden_size")), "hidden_size is missing"),
    (lambda p: _config(p, lambda c: c.update(architectures=["LlamaForCausalLM"])), "is not an EAGLE-3 draft"),
    (lambda p: _config(p, lambda c: c.update(target_hidden_size=7168)), "a target of hidden size 7168"),
    (lambda p: _config(p, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 9, 3])),
     r"outside the target's 1..3"),
    (lambda p: _config(p, lambda c: c.update(quantization_config={"quant_method": "fp8"})), "quantized drafts"),
    (lambda p: (p / "model.safetensors").unlink(), "no .safetensors file"),
    (lambda p: (p / "config.json").unlink(), "no config.json"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 12), "model.safetensors"),
]


@pytest.mark.parametrize("damage, message", DAMAGE)
def test_a_damaged_draft_is_one_line(drafts, tmp_path, damage, message):
    broken = tmp_path / "draft"
    shutil.copytree(drafts["llama"], broken)
    damage(broken)
    with pytest.raises(DraftError, match=message) as e:
        load_draft(broken, TINY)
    assert "\n" not in str(e.value)


def test_a_draft_for_another_model_is_refused(drafts):
    bigger = K2Config.preset("tiny-int4")  # same width and vocabulary: accepted
    assert load_draft(drafts["mla"], bigger).config.layout == "mla"
    with pytest.raises(DraftError, match="hidden size 128, the model's is 7168"):
        load_draft(drafts["llama"], K2)


def test_a_draft_resolves_through_the_hf_cache(drafts, tmp_path, monkeypatch):
    from test_int4 import _cache

    snap = _cache(tmp_path / "hub", "AQ-MedAI/Kimi-K2-Instruct-eagle3", drafts["llama"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    draft = load_draft("AQ-MedAI/Kimi-K2-Instruct-eagle3", TINY)
    assert draft.root == snap and draft.config.layout == "llama"


@pytest.mark.parametrize("form", DRAFT_FORMATS)
def test_make_tiny_writes_each_draft(tmp_path, capsys, form):
    assert main(["make-tiny", str(tmp_path / form), "--draft", form]) == 0
    assert f"tiny EAGLE-3 draft ({form})" in capsys.readouterr().out
    assert load_draft(tmp_path / form, TINY).config == tiny_draft_config(TINY, form)[0]


def test_a_speculators_draft_gives_its_own_k_where_none_is_asked(drafts, tmp_path):
    """vLLM's rule: a speculators draft's speculative_tokens is the k when --speculative-config names none; one
    that names it keeps its own; a draft's k outside 1..16 is one line."""
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.runtime.generation.eagle import make_drafter
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.scheduler import Scheduler
    from k2trt.runtime.generation.speculation import SpeculativeConfig
    from k2trt.tiny.synthetic import RandomWeights

    five = tmp_path / "five"
    shutil.copytree(drafts["speculators"], five)
    _config(five, lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5))
    assert load_draft(drafts["speculators"], TINY).config.speculative_tokens == 3
    assert load_draft(drafts["llama"], TINY).config.speculative_tokens is None
    assert load_draft(five, TINY).config.fingerprint() == load_draft(drafts["speculators"], TINY).config.fingerprint()
    weights = RandomWeights(TINY)
    backend = TorchBackend(weights, "float32", 0)
    limits = Limits(max_context=64, max_batch=1, prefill_chunk=8)
    for text, k in ((json.dumps({"method": "eagle3", "model": str(five)}), 5),
                    (json.dumps({"method": "eagle3", "model": str(five), "num_speculative_tokens": 2}), 2),
                    (json.dumps({"method": "eagle3", "model": str(drafts["llama"])}), 3)):
        spec = SpeculativeConfig.parse(text)
        sched = Scheduler(StageExecutor(backend, TINY), TINY, limits, speculation=spec,
                          drafter=make_drafter(spec, TINY, weights, backend))
        assert sched.speculation.num_speculative_tokens == k, text
    _config(five, lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=40))
    with pytest.raises(DraftError, match=r"speculative_tokens must be 1..16, got 40"):
        load_draft(five, TINY)
