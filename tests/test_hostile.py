"""Hostile inputs: every damaged file and bad value gets one clear line (`k2trt X: error: ...`, exit 2, no
traceback); nothing hangs; nothing runs on values the model cannot compute with. One test per class of input,
several cases each (the header fuzzer is tests/test_safetensors_fuzz.py)."""

from __future__ import annotations

import json

import pytest
import torch

from fixtures import clone, one_error_line, rewrite_tensors, shard_of
from k2trt.checkpoint import Checkpoint, CheckpointError
from k2trt.cli import main

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
INDEX = "model.safetensors.index.json"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- 2. every tensor a command uses is checked against the weight table ---------------------------------

GLOBAL_DAMAGE = {
    "lm_head missing": (HEAD, lambda t: t.pop(HEAD), "missing tensor 'lm_head.weight'"),
    "embedding of the wrong shape": (EMBED, lambda t: t.update({EMBED: t[EMBED][:, :64].clone()}),
                                     "has shape [2048, 64], expected [2048, 128]"),
    "final norm stored as FP8": (NORM, lambda t: t.update({NORM: t[NORM].to(torch.float8_e4m3fn)}),
                                 "has dtype float8_e4m3fn, expected bfloat16"),
    "lm_head in float32": (HEAD, lambda t: t.update({HEAD: t[HEAD].float()}), "has dtype float32, expected bfloat16"),
}


@pytest.mark.parametrize("case", list(GLOBAL_DAMAGE))
def test_generate_refuses_the_globals_inspect_refuses(tiny_ckpt, tiny_export, tmp_path, capsys, case):
    name, edit, message = GLOBAL_DAMAGE[case]
    shard = shard_of(tiny_ckpt, name)
    broken = clone(tiny_ckpt, tmp_path / "ckpt", copy=(shard, INDEX))
    rewrite_tensors(broken, shard, edit)
    for argv in (["generate", "--model", str(broken), "--onnx", str(tiny_export), "--prompt", "Hi"],
                 ["generate", "--model", str(broken), "--backend", "torch", "--prompt", "Hi"],
                 ["inspect", str(broken)]):
        rc, out, err = cli(capsys, *argv)
        if argv[0] == "inspect":  # inspect prints its table and the differences, and exits 1
            assert rc == 1 and message in out
        else:
            assert message in one_error_line(rc, err, "generate")
    # Not only at load: a weight source never hands out a tensor the table refuses.
    with pytest.raises(CheckpointError, match="lm_head|model.norm|embed_tokens"):
        Checkpoint.open(broken).globals()


# ---- 3. config values are checked for meaning, not only type -------------------------------------------

def _set(key: str, value):
    def edit(d: dict) -> None:
        where, _, leaf = key.rpartition(".")
        (d[where] if where else d)[leaf] = value
    return edit


CONFIG_DAMAGE = {
    "rms_norm_eps NaN": (_set("rms_norm_eps", float("nan")), "rms_norm_eps must be a finite number > 0"),
    "rms_norm_eps negative": (_set("rms_norm_eps", -1e-6), "rms_norm_eps must be a finite number > 0"),
    "YaRN factor infinite": (_set("rope_scaling.factor", float("inf")), "rope_scaling.factor must be a finite"),
    "rope_theta 0": (_set("rope_theta", 0), "rope_theta must be a finite number > 1"),
    "rope_theta negative": (_set("rope_theta", -50000.0), "rope_theta must be a finite number > 1"),
    "original_max_position_embeddings negative": (_set("rope_scaling.original_max_position_embeddings", -4096),
                                                  "original_max_position_embeddings must be an integer in 1.."),
    "beta_slow 0": (_set("rope_scaling.beta_slow", 0), "rope_scaling.beta_slow must be a finite number > 0"),
    "routed_scaling_factor NaN": (_set("routed_scaling_factor", float("nan")), "routed_scaling_factor must be"),
    "a billion layers": (_set("num_hidden_layers", 10**9), "num_hidden_layers 1,000,000,000 is beyond"),
    "a hundred million experts": (_set("n_routed_experts", 10**8), "n_routed_experts 100,000,000 is beyond"),
    "experts x layers": (lambda d: d.update(n_routed_experts=8192, num_hidden_layers=1000), "tensors (1000 layers"),
    "an integer of 5000 digits": (lambda d: json.dumps(d).replace('"vocab_size": 2048', '"vocab_size": ' + "9" * 5000),
                                  "not valid JSON (Exceeds the limit"),
    "nested 100,000 deep": (lambda d: json.dumps(d)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                            "not valid JSON (nested too deeply)"),
    "torch_dtype a list": (_set("torch_dtype", ["bfloat16"]), "torch_dtype must be a string"),
}


@pytest.mark.parametrize("case", list(CONFIG_DAMAGE))
def test_config_values_the_model_cannot_compute_with_are_refused(tiny_ckpt, tiny_export, tmp_path, capsys, case):
    edit, message = CONFIG_DAMAGE[case]  # edits the config in place, or returns the damaged text
    broken = clone(tiny_ckpt, tmp_path / "ckpt", copy=("config.json",))
    d = json.loads((broken / "config.json").read_text())
    text = edit(d)
    (broken / "config.json").write_text(text if isinstance(text, str) else json.dumps(d))
    for argv in (["inspect", str(broken)],
                 ["export", "--model", str(broken), "--out", str(tmp_path / "onnx")],
                 ["generate", "--model", str(broken), "--onnx", str(tiny_export), "--prompt", "Hi"]):
        rc, _, err = cli(capsys, *argv)
        assert message in one_error_line(rc, err, argv[0])
    assert not (tmp_path / "onnx").exists()


def test_config_tensor_count_follows_the_weight_table():
    import dataclasses

    from k2trt.config import K2Config, tensor_count
    from k2trt.graphs.weights import checkpoint_specs

    tiny = K2Config.preset("tiny")
    for cfg in (tiny, K2Config.preset("kimi-k2"), dataclasses.replace(tiny, first_k_dense_replace=3, moe_layer_freq=2),
                dataclasses.replace(tiny, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2)):
        assert tensor_count(cfg) == len(checkpoint_specs(cfg))
