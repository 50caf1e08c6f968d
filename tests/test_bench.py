"""`k2trt bench` and its transformers baseline: the table's rows and ratios, the missing-extra note, and
transformers' DeepseekV3 on our checkpoint choosing the reference's greedy tokens (no timings are asserted)."""

import json

import pytest
import torch

from k2trt.checkpoint import Checkpoint
from k2trt.cli import main
from k2trt.config import K2Config
from k2trt.errors import MissingDependency
from k2trt.graphs import blocks
from k2trt.graphs.reference import ReferenceModel, greedy_generate
from k2trt.tools import hf_baseline

transformers = pytest.importorskip("transformers", reason="the bench extra (pip install 'k2trt[bench]') is not installed")

BENCH = ["--prompt-len", "8", "--batch", "2", "--new-tokens", "3", "--repeat", "1", "--json"]


# a short prompt (the reference attends absorbed throughout) and one past the switch point (its prefill decompressed)
@pytest.mark.parametrize("length", [12, blocks.decompress_from(K2Config.preset("tiny")) + 10])
def test_transformers_on_our_checkpoint_picks_the_reference_tokens(tiny_ckpt, length):
    ckpt = Checkpoint.open(tiny_ckpt)
    model = hf_baseline.build_hf_model(ckpt)
    prompts = torch.randint(0, 1792, (2, length), generator=torch.Generator().manual_seed(3)).tolist()
    tokens, timings = hf_baseline.hf_generate(model, prompts, 12)
    ref = ReferenceModel(ckpt)
    assert tokens == [greedy_generate(ref, p, 12)[0] for p in prompts]
    assert timings.prefill_tokens == 2 * length and timings.decode_tokens == 22 and timings.prefill_s > 0


def test_experts_are_stacked_as_transformers_names_them():
    gate, up, down = torch.randn(3, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 8, 4)
    state = hf_baseline.hf_layer_state({"mlp.experts.gate_proj.weight": gate, "mlp.experts.up_proj.weight": up,
                                        "mlp.experts.down_proj.weight": down, "input_layernorm.weight": torch.ones(8)})
    assert set(state) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "input_layernorm.weight"}
    assert torch.equal(state["mlp.experts.gate_up_proj"][:, :4], gate)  # gate rows, then up rows
    assert torch.equal(state["mlp.experts.gate_up_proj"][:, 4:], up)


@pytest.mark.slow
def test_bench_reports_every_row_against_both_baselines(tiny_ckpt, tiny_export, capsys):
    rc = main(["bench", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), *BENCH])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["backends"] == ["runtime", "transformers", "reference"]
    assert [(r["batch"], r["prompt"]) for r in out["rows"]] == [(2, 8)]
    for r in out["rows"]:
        assert r["tokens_agree_with_transformers"] == 1.0
        for phase in ("prefill", "decode"):
            assert r[f"ratio_{phase}_runtime_over_transformers"] > 0
            assert r[f"ratio_{phase}_runtime_over_reference"] > 0


def test_bench_without_transformers_says_how_to_get_it(tiny_ckpt, tiny_export, capsys, monkeypatch):
    def missing():
        raise MissingDependency(f"transformers is not installed ({hf_baseline.INSTALL_HINT})")

    monkeypatch.setattr(hf_baseline, "transformers_module", missing)
    rc = main(["bench", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), *BENCH[:-1]])
    out = capsys.readouterr().out
    assert rc == 0 and "pip install 'k2trt[bench]'" in out
    assert "decode ×refer" in out and "×trans" not in out  # the reference row is still reported


def test_bench_bad_arguments_give_one_line(tiny_ckpt, tiny_export, capsys):
    rc = main(["bench", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--baselines", "llama"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "unknown baseline" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_bench_speculating_keeps_transformers_tokens(tiny_ckpt, tiny_export, capsys):
    """--speculative-config: the runtime speculates (prompt lookup) while the baselines decode plainly — its
    greedy tokens still transformers' own, and each row says what the verify steps gave."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    rc = main(["bench", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), *BENCH, "--new-tokens", "24",
               "--speculative-config", spec])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["speculative_config"] == "ngram"
    for r in out["rows"]:
        assert r["tokens_agree_with_transformers"] == 1.0
        assert "runtime_mean_accepted_length" in r
