"""The safetensors reader and Checkpoint: round trips against the official loader, and a clear error for
each kind of broken checkpoint (naming the tensor and the shard)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file as official_load

from fixtures import clone, rewrite_header, shard_of, tiny_checkpoint
from k2trt.checkpoint import Checkpoint, CheckpointError
from k2trt.config import ConfigError, K2Config
from k2trt.graphs.fp8 import dequant_weight, quantize_weight
from k2trt.graphs.weights import block_weight_specs, checkpoint_specs, global_specs, layer_specs
from k2trt.safetensors_io import SafetensorsFile, load_file, save_file
from k2trt.tiny.synthetic import synthetic_tensors


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (fp8 has no CPU equality kernel; NaN bit patterns compare too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# ---- round trips ---------------------------------------------------------------------------------

def test_every_tensor_equals_the_official_loader(tiny):
    ckpt = Checkpoint.open(tiny)
    shards = sorted(set(ckpt.weight_map.values()))
    seen = 0
    for shard in shards:
        ref = official_load(str(tiny / shard))
        for name, t in ref.items():
            assert ckpt.weight_map[name] == shard
            assert same(ckpt.tensor(name), t), name
            seen += 1
    assert seen == len(ckpt.weight_map) == len(checkpoint_specs(ckpt.config))


def test_config_and_validation(tiny):
    ckpt = Checkpoint.open(tiny)
    assert ckpt.config == K2Config.preset("tiny")
    ckpt.validate()
    assert ckpt.problems() == []
    headers = ckpt.header_specs()
    for name, spec in checkpoint_specs(ckpt.config).items():
        assert headers[name].dtype == spec.dtype and headers[name].shape == spec.shape
        assert headers[name].shard == ckpt.weight_map[name]


def test_layer_globals_and_zero_copy(tiny):
    ckpt = Checkpoint.open(tiny)
    cfg = ckpt.config
    for i in range(cfg.num_hidden_layers):
        assert set(ckpt.layer(i)) == {s.name for s in layer_specs(cfg, i)}
    assert set(ckpt.globals()) == {s.name for s in global_specs(cfg)}
    name = "model.layers.1.mlp.experts.7.up_proj.weight"
    assert ckpt.tensor(name).data_ptr() == ckpt.tensor(name).data_ptr()  # views of one mapping
    assert same(ckpt.read(name), ckpt.tensor(name))
    # Copy-on-write: writing into a mapped tensor never reaches the file.
    t = ckpt.tensor("model.norm.weight")
    before = t.clone()
    t.fill_(7)
    assert same(Checkpoint.open(tiny).tensor("model.norm.weight"), before)


def test_block_weights_stack_experts_in_spec_order(tiny):
    ckpt = Checkpoint.open(tiny)
    cfg = ckpt.config
    for i in (0, 2):
        bw = ckpt.block_weights(i)
        specs = block_weight_specs(cfg, cfg.layer_kind(i))
        assert list(bw) == [s.name for s in specs]
        for s in specs:
            assert bw[s.name].shape == s.shape and str(bw[s.name].dtype) == f"torch.{s.dtype}"
    bw = ckpt.block_weights(2)
    for e in (0, 5, cfg.n_routed_experts - 1):
        for suffix in ("down_proj.weight", "down_proj.weight_scale_inv"):
            assert same(bw[f"mlp.experts.{suffix}"][e], ckpt.tensor(f"model.layers.2.mlp.experts.{e}.{suffix}"))
    assert same(bw["self_attn.o_proj.weight"], ckpt.tensor("model.layers.2.self_attn.o_proj.weight"))


def test_single_file_checkpoint(tmp_path):
    cfg = dataclasses.replace(K2Config.preset("tiny"), n_routed_experts=8, num_experts_per_tok=2,
                              num_hidden_layers=2)
    tensors = dict(synthetic_tensors(cfg, seed=3))
    save_file(tensors, tmp_path / "model.safetensors")
    cfg.write_json(tmp_path / "config.json")
    ckpt = Checkpoint.open(tmp_path)
    ckpt.validate()
    assert set(ckpt.weight_map.values()) == {"model.safetensors"}
    for name, t in tensors.items():
        assert same(ckpt.tensor(name), t), name
    assert ckpt.block_weights(1)["mlp.experts.gate_proj.weight"].shape == (8, 128, 128)


def test_reader_handles_every_dtype_and_odd_shapes(tmp_path):
    tensors = {
        "f16": torch.randn(3, 5).half(), "bf16": torch.randn(7).bfloat16(), "f32": torch.randn(2, 3, 4),
        "f64": torch.randn(3).double(), "i64": torch.arange(5), "i32": torch.arange(6, dtype=torch.int32),
        "i8": torch.tensor([-1, 2], dtype=torch.int8), "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    ours = load_file(path)
    assert set(ours) == set(tensors)
    for name, t in tensors.items():
        assert same(ours[name], t), name
        assert same(SafetensorsFile(path).read(name), t), name
    assert SafetensorsFile(path).metadata == {"format": "pt"}


def test_fp8_block_dequant_partial_edge_blocks(tmp_path):
    w = torch.randn(192, 128, generator=torch.Generator().manual_seed(0))
    w[128:] *= 10  # the partial second row of blocks gets its own, larger scale
    q, s = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (192, 128) and s.shape == (2, 1)
    assert s[1, 0] > 5 * s[0, 0]
    assert torch.allclose(s[1, 0], w[128:].abs().max() / 448)
    save_file({"w.weight": q, "w.weight_scale_inv": s}, tmp_path / "w.safetensors")
    f = load_file(tmp_path / "w.safetensors")
    d = dequant_weight(f["w.weight"], f["w.weight_scale_inv"])
    assert torch.equal(d[:128], q[:128].float() * s[0, 0]) and torch.equal(d[128:], q[128:].float() * s[1, 0])
    assert ((d - w).abs() <= w.abs() * 2**-3 + 1e-6).all()  # within e4m3's 3-bit mantissa rounding


# ---- broken checkpoints --------------------------------------------------------------------------

NORM = "model.layers.2.input_layernorm.weight"
LINEAR = "model.layers.1.self_attn.q_b_proj.weight"


def _error(path, config=None) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as e:
        Checkpoint.open(path).validate(config)
    return str(e.value)


def test_missing_shard(tiny, tmp_path):
    shard = shard_of(tiny, LINEAR)
    clone(tiny, tmp_path)
    (tmp_path / shard).unlink()
    msg = _error(tmp_path)
    assert shard in msg and "missing" in msg and "model." in msg


def test_truncated_shard(tiny, tmp_path):
    shard = shard_of(tiny, LINEAR)
    clone(tiny, tmp_path, copy=(shard,))
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[:len(data) // 2])
    msg = _error(tmp_path)
    assert shard in msg and "truncated" in msg
    with pytest.raises(CheckpointError, match=shard):
        Checkpoint.open(tmp_path).tensor(LINEAR)


def test_header_that_lies(tiny, tmp_path):
    shard = shard_of(tiny, LINEAR)
    clone(tiny, tmp_path, copy=(shard,))
    original = (tmp_path / shard).read_bytes()

    def by_offset(h):
        return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])

    def grow(h, name):  # `name` claims twice its bytes
        b, e = h[name]["data_offsets"]
        h[name]["shape"] = [2 * h[name]["shape"][0], *h[name]["shape"][1:]]
        h[name]["data_offsets"] = [b, b + 2 * (e - b)]

    rewrite_header(tmp_path / shard, lambda h: grow(h, by_offset(h)[-1]))  # past the end of the file
    msg = _error(tmp_path)
    assert shard in msg and "shorter than its header says" in msg

    (tmp_path / shard).write_bytes(original)
    rewrite_header(tmp_path / shard, lambda h: grow(h, by_offset(h)[0]))  # over the next tensor
    msg = _error(tmp_path)
    assert shard in msg and "lies" in msg and "invalid offset for tensor" in msg


def test_bad_shard_header_json(tiny, tmp_path):
    shard = shard_of(tiny, LINEAR)
    clone(tiny, tmp_path, copy=(shard,))
    blob = bytearray((tmp_path / shard).read_bytes())
    blob[8:20] = b"{not json!!!"
    (tmp_path / shard).write_bytes(bytes(blob))
    msg = _error(tmp_path)
    assert shard in msg and "JSON" in msg


def test_wrong_dtype(tiny, tmp_path):
    shard = shard_of(tiny, NORM)
    clone(tiny, tmp_path, copy=(shard,))
    rewrite_header(tmp_path / shard, lambda h: h[NORM].update(dtype="F16"))  # same bytes, wrong type
    msg = _error(tmp_path)
    assert shard in msg and NORM in msg and "float16" in msg and "bfloat16" in msg
    with pytest.raises(CheckpointError, match="input_layernorm"):
        Checkpoint.open(tmp_path).block_weights(2)


def test_wrong_shape(tiny, tmp_path):
    shard = shard_of(tiny, LINEAR)
    clone(tiny, tmp_path, copy=(shard,))
    old = None

    def reshape(h):
        nonlocal old
        old = h[LINEAR]["shape"]
        h[LINEAR]["shape"] = [old[0] // 2, old[1] * 2]

    rewrite_header(tmp_path / shard, reshape)
    msg = _error(tmp_path)
    assert shard in msg and LINEAR in msg and "shape" in msg and str(old) in msg


def test_bad_index_json(tiny, tmp_path):
    clone(tiny, tmp_path, copy=("model.safetensors.index.json",))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {')
    msg = _error(tmp_path)
    assert "model.safetensors.index.json" in msg and "JSON" in msg


def test_bad_config_json(tiny, tmp_path):
    clone(tiny, tmp_path, copy=("config.json",))
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k2",,}')
    msg = _error(tmp_path)
    assert "config.json" in msg and "JSON" in msg


def test_extra_and_missing_tensors(tiny, tmp_path):
    shard = shard_of(tiny, NORM)
    clone(tiny, tmp_path, copy=(shard, "model.safetensors.index.json"))
    tensors = {k: v.clone() for k, v in load_file(tmp_path / shard).items()}
    del tensors[NORM]
    tensors["model.layers.2.mystery.weight"] = torch.zeros(4)
    (tmp_path / shard).unlink()
    save_file(tensors, tmp_path / shard)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"][NORM]
    index["weight_map"]["model.layers.2.mystery.weight"] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = Checkpoint.open(tmp_path).problems()
    assert any("unexpected" in p and "mystery" in p and shard in p for p in problems)
    assert any("missing" in p and NORM in p for p in problems)
    assert "more problem" in _error(tmp_path)


def test_index_names_a_tensor_the_shard_lacks(tiny, tmp_path):
    clone(tiny, tmp_path, copy=("model.safetensors.index.json",))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    right = index["weight_map"][NORM]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != right)
    index["weight_map"][NORM] = wrong
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _error(tmp_path)
    assert NORM in msg and wrong in msg
    with pytest.raises(CheckpointError, match="header does not have it"):
        Checkpoint.open(tmp_path).tensor(NORM)


def test_multi_token_prediction_layers_are_allowed_but_nothing_else(tmp_path):
    """DeepSeek-V3 stores num_nextn_predict_layers extra layers after the last decoder layer."""
    cfg = dataclasses.replace(K2Config.preset("tiny"), model_type="deepseek_v3", n_routed_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=2, num_nextn_predict_layers=1)
    tensors = dict(synthetic_tensors(cfg, seed=4))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    cfg.write_json(tmp_path / "config.json")
    Checkpoint.open(tmp_path).validate()
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.3.eh_proj.weight'"):
        Checkpoint.open(tmp_path).validate()
