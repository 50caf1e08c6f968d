"""make-tiny: K2's exact on-disk format, deterministic, atomic."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from fixtures import tiny_checkpoint
from k2trt import cli
from k2trt.tiny import checkpoint as tiny_mod
from k2trt.checkpoint import Checkpoint
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.fp8 import dequant_weight
from k2trt.graphs.weights import checkpoint_specs
from k2trt.checkpoint_writer import ordered_specs, shard_plan
from k2trt.tiny.synthetic import synthetic_tensors
from k2trt.tiny.checkpoint import make_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def test_layout_matches_k2(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert 6 <= len(shards) <= 8
    assert all(re.fullmatch(rf"model-000\d\d-of-{len(shards):06d}\.safetensors", s) for s in shards)
    assert sorted(p.name for p in tiny.glob("*.safetensors")) == shards
    cfg = K2Config.preset("tiny")
    specs = checkpoint_specs(cfg)
    assert set(index["weight_map"]) == set(specs)
    assert index["metadata"]["total_size"] == sum(
        s.numel * getattr(torch, s.dtype).itemsize for s in specs.values())
    # config.json carries every field, and reads back as the preset
    raw = json.loads((tiny / "config.json").read_text())
    assert set(cfg.to_hf_dict()) <= set(raw)
    assert K2Config.from_json(tiny) == cfg
    assert (tiny / "tiktoken.model").exists() and (tiny / "tokenizer_config.json").exists()
    total = sum(p.stat().st_size for p in tiny.iterdir())
    assert total < 100e6
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_a_weight_and_its_scale_in_different_shards(tiny):
    wm = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    split = [n for n in wm if n.endswith(".weight") and wm.get(n + "_scale_inv", wm[n]) != wm[n]]
    assert split
    ckpt = Checkpoint.open(tiny)  # and the reader pairs them up anyway
    w = split[0]
    assert dequant_weight(ckpt.tensor(w), ckpt.tensor(w + "_scale_inv")).isfinite().all()


def test_dtypes_and_initialization(tiny):
    ckpt = Checkpoint.open(tiny)
    ckpt.validate()
    t = ckpt.tensor
    assert t("model.embed_tokens.weight").dtype == torch.bfloat16
    assert t("lm_head.weight").dtype == torch.bfloat16
    assert t("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert t("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert t("model.layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn
    assert t("model.layers.0.mlp.down_proj.weight_scale_inv").dtype == torch.float32
    norm = t("model.layers.3.post_attention_layernorm.weight").float()
    assert (norm - 1).abs().max() < 0.3 and norm.std() > 0.01
    # std 1/sqrt(in) for linears, half that for the residual-writing ones
    q_a = dequant_weight(t("model.layers.2.self_attn.q_a_proj.weight"), t("model.layers.2.self_attn.q_a_proj.weight_scale_inv"))
    o = dequant_weight(t("model.layers.2.self_attn.o_proj.weight"), t("model.layers.2.self_attn.o_proj.weight_scale_inv"))
    assert q_a.std().item() == pytest.approx(128 ** -0.5, rel=0.1)
    assert o.std().item() == pytest.approx(0.5 * 256 ** -0.5, rel=0.1)


def test_same_seed_same_bytes_via_cli(tiny, tmp_path, capsys):
    out = tmp_path / "again"
    assert cli.main(["make-tiny", str(out), "--seed", "0"]) == 0
    assert "shards" in capsys.readouterr().out
    files = sorted(p.name for p in tiny.iterdir())
    assert sorted(p.name for p in out.iterdir()) == files
    for name in files:
        assert (out / name).read_bytes() == (tiny / name).read_bytes(), name


def test_different_seed_different_weights():
    cfg = K2Config.preset("tiny")
    a = next(synthetic_tensors(cfg, seed=0))[1]
    b = next(synthetic_tensors(cfg, seed=1))[1]
    assert not torch.equal(a, b)


def test_refuses_non_empty_dir(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert cli.main(["make-tiny", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    def boom(out_dir, *a, **k):
        (out_dir / "half.safetensors").write_bytes(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_mod, "write_checkpoint", boom)
    with pytest.raises(KeyboardInterrupt):
        make_tiny(tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_force_replaces(tmp_path, monkeypatch):
    small = dataclasses.replace(K2Config.preset("tiny"), n_routed_experts=8, num_experts_per_tok=2,
                                num_hidden_layers=2)
    out = tmp_path / "t"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(K2Error):
        make_tiny(out, config=small)
    make_tiny(out, config=small, force=True)
    assert not (out / "old.txt").exists()
    Checkpoint.open(out).validate()
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_shard_plan_cuts_between_weight_and_scale():
    plan = shard_plan(ordered_specs(K2Config.preset("tiny")), 7)
    for shard in plan[:-1]:
        assert shard[-1].dtype == "float8_e4m3fn"
    assert [s for shard in plan for s in shard] == ordered_specs(K2Config.preset("tiny"))


# ---- --kv-lora-rank: the tiny at K2's latent width (512 + 64 = 576 cached values, what vLLM's CPU MLA takes) --------

@pytest.mark.slow
def test_kv_lora_rank_512_writes_a_checkpoint_the_project_runs(tmp_path, capsys):
    from k2trt.graphs.reference import ReferenceModel, greedy_generate
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    out = tmp_path / "k512"
    assert cli.main(["make-tiny", str(out), "--kv-lora-rank", "512"]) == 0
    assert "kv_lora_rank 512" in capsys.readouterr().out
    raw = json.loads((out / "config.json").read_text())
    assert (raw["kv_lora_rank"], raw["qk_rope_head_dim"]) == (512, 64)
    cfg = K2Config.from_json(out)
    assert cfg == dataclasses.replace(K2Config.preset("tiny"), kv_lora_rank=512) and cfg.latent_dim == 576
    ckpt = Checkpoint.open(out)
    ckpt.validate()
    assert ckpt.tensor("model.layers.1.self_attn.kv_b_proj.weight").shape == (4 * (64 + 64), 512)
    # the torch reference and the runtime's torch backend generate the same tokens from it
    tok = KimiTokenizer.from_dir(out)
    ids = tok.encode("The quick brown fox")
    expect, first = greedy_generate(ReferenceModel(ckpt), ids, 6)
    assert first.isfinite().all()
    (res,), _ = Generator(open_backend(BackendChoice("torch"), ckpt), ckpt.config).generate([ids], 6)
    assert res.token_ids == expect
    # and transformers reads it as vLLM does: its config through configuration_deepseek.py, its tokenizer through
    # tokenization_kimi.py
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        return
    hf = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert (hf.model_type, hf.kv_lora_rank, hf.qk_rope_head_dim) == ("kimi_k2", 512, 64)
    assert AutoTokenizer.from_pretrained(out, trust_remote_code=True).encode("The quick brown fox") == ids


@pytest.mark.parametrize("argv, says", [
    (["--kv-lora-rank", "100"], "kv_lora_rank (100) must be a multiple of 128"),  # FP8's 128-wide activation groups
    (["--kv-lora-rank", "0"], "must be >= 1, got 0"),
])
def test_kv_lora_rank_out_of_range_is_refused_before_writing(tmp_path, capsys, argv, says):
    assert cli.main(["make-tiny", str(tmp_path / "t"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_kv_lora_rank_applies_to_every_format():
    for fmt, (preset, _) in tiny_mod.FORMATS.items():
        cfg = tiny_mod.with_kv_lora_rank(K2Config.preset(preset), 512)
        assert cfg == dataclasses.replace(K2Config.preset(preset), kv_lora_rank=512), fmt
    assert tiny_mod.with_kv_lora_rank(K2Config.preset("tiny-int4"), 96).kv_lora_rank == 96  # bf16 attention: any width


def test_transformers_loads_the_tinys_config_and_tokenizer(tiny):
    """AutoTokenizer reads the model's config first: config.json's auto_map names configuration_deepseek.py and
    tokenizer_config.json's names tokenization_kimi.py, so make-tiny writes both (k2trt's own)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the bench extra "
                                                              "installs it); AutoConfig/AutoTokenizer cannot be checked")
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    assert (tiny / "configuration_deepseek.py").exists() and (tiny / "tokenization_kimi.py").exists()
    hf = transformers.AutoConfig.from_pretrained(tiny, trust_remote_code=True)
    cfg = K2Config.preset("tiny")
    assert (hf.model_type, hf.architectures, hf.kv_lora_rank, hf.n_routed_experts, hf.topk_method) == \
        ("kimi_k2", ["DeepseekV3ForCausalLM"], cfg.kv_lora_rank, cfg.n_routed_experts, "noaux_tc")
    tok = transformers.AutoTokenizer.from_pretrained(tiny, trust_remote_code=True)
    text = "Hello<|im_end|> 你好"
    assert tok.encode(text) == KimiTokenizer.from_dir(tiny).encode(text, allow_special=True)
