"""`k2trt inspect`: K2's published parameter figures, and the header cross-check on a checkpoint."""

from __future__ import annotations

import json

import pytest

from fixtures import clone, rewrite_header, shard_of, tiny_checkpoint
from k2trt import cli
from k2trt.config import K2Config
from k2trt.tools.inspect_checkpoint import parameter_rows
from k2trt.safetensors_io import load_file, save_file


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["inspect", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _line(text: str, component: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(component + "  "))


def test_kimi_k2_figures(capsys):
    rc, out, _ = _run(capsys, "--preset", "kimi-k2")
    assert rc == 0
    assert "44,040,192" in _line(out, "one routed expert")
    assert "17,059,365,248" in _line(out, "MoE block")
    assert "497,500,160" in _line(out, "dense block")
    assert "1,024,059,415,040" in _line(out, "all 61 blocks")
    assert "101,124,096" in _line(out, "attention")
    assert "2,752,512" in _line(out, "router weight")
    assert "1,026,408,232,448" in _line(out, "model total")
    for component in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                      "kv_b_proj", "o_proj", "shared expert", "router bias", "embeddings", "final norm",
                      "lm_head"):
        _line(out, component)


def test_kimi_k2_rows_add_up():
    rows = {r.component: r for r in parameter_rows(K2Config.preset("kimi-k2"))}
    attn = sum(rows[c].per_instance for c in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                              "kv_a_layernorm", "kv_b_proj", "o_proj"))
    assert attn == rows["attention"].per_instance == 101_124_096
    moe = (attn + rows["input + post-attention norms"].per_instance + rows["384 routed experts"].per_instance
           + rows["shared expert"].per_instance + rows["router weight"].per_instance
           + rows["router bias"].per_instance)
    assert moe == rows["MoE block"].per_instance == 17_059_365_248
    assert rows["all 61 blocks"].total == rows["dense block"].total + rows["MoE block"].total


def test_json_mode(capsys):
    rc, out, _ = _run(capsys, "--preset", "kimi-k2", "--json")
    assert rc == 0
    data = json.loads(out)
    rows = {r["component"]: r for r in data["rows"]}
    assert rows["one routed expert"]["per_instance"] == 44_040_192
    assert rows["MoE block"]["per_instance"] == 17_059_365_248 and rows["MoE block"]["count"] == 60
    assert rows["all 61 blocks"]["total"] == 1_024_059_415_040
    assert data["cross_check"] is None


def test_tiny_checkpoint_cross_check_passes(tiny, capsys):
    rc, out, _ = _run(capsys, str(tiny))
    assert rc == 0, out
    assert "every count matches" in out
    rc, out, _ = _run(capsys, str(tiny), "--json")
    data = json.loads(out)
    assert rc == 0 and data["cross_check"] == {"ok": True, "differences": []}
    assert all(r["headers_total"] == r["total"] for r in data["rows"])
    rc, out, _ = _run(capsys, "--preset", "tiny", "--json")
    assert json.loads(out)["total"] == data["total"]


def test_cross_check_reports_a_difference(tiny, tmp_path, capsys):
    name = "model.layers.2.mlp.experts.9.up_proj.weight"
    shard = shard_of(tiny, name)
    clone(tiny, tmp_path, copy=(shard,))

    def shrink(h):  # same bytes, a different (wrong) shape
        rows, cols = h[name]["shape"]
        h[name]["shape"] = [rows * 2, cols // 2]

    rewrite_header(tmp_path / shard, shrink)
    rc, out, _ = _run(capsys, str(tmp_path))
    assert rc == 1
    assert "difference" in out and name in out and shard in out
    rc, out, _ = _run(capsys, str(tmp_path), "--json")
    data = json.loads(out)
    assert rc == 1 and not data["cross_check"]["ok"] and any(name in d for d in data["cross_check"]["differences"])


def test_count_difference_is_reported(tiny, tmp_path, capsys):
    name = "model.layers.2.mlp.experts.9.up_proj.weight"
    shard = shard_of(tiny, name)
    clone(tiny, tmp_path, copy=(shard,))
    tensors = {k: v.clone() for k, v in load_file(tmp_path / shard).items()}
    tensors[name] = tensors[name][:64].clone()  # half the rows: 8,192 parameters short
    (tmp_path / shard).unlink()
    save_file(tensors, tmp_path / shard)
    rc, out, _ = _run(capsys, str(tmp_path))
    assert rc == 1
    assert "routed expert up_proj: config 18,874,368, headers 18,866,176" in out
    assert "MoE block: config 57,535,104, headers 57,526,912" in out
    assert name in out and "[64, 128]" in out


def test_dtype_difference_is_reported(tiny, tmp_path, capsys):
    name = "model.layers.3.mlp.gate.e_score_correction_bias"
    shard = shard_of(tiny, name)
    clone(tiny, tmp_path, copy=(shard,))
    rewrite_header(tmp_path / shard, lambda h: h[name].update(dtype="I32"))  # same bytes, wrong dtype
    rc, out, _ = _run(capsys, str(tmp_path))
    assert rc == 1 and name in out and "int32" in out


def test_usage_errors(capsys, tmp_path):
    assert _run(capsys)[0] == 2
    assert _run(capsys, str(tmp_path), "--preset", "tiny")[0] == 2
    rc, _, err = _run(capsys, "--preset", "nope")
    assert rc == 2 and "unknown preset" in err
    rc, _, err = _run(capsys, str(tmp_path))
    assert rc == 2 and "config.json" in err
