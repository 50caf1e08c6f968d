"""`k2trt compare` on the embedded tiny checkpoint: it passes on a faithful export, the polygraphy files it saves
re-check with the plain polygraphy CLI, and it fails — naming the block — on a perturbed weight or a wrong rope."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k2trt.checkpoint import Checkpoint
from k2trt.cli import main
from k2trt.files import sha256_file
from k2trt.graphs.rope import inv_freq
from k2trt.tools.compare.compare import Setup, compare
from k2trt.tools.compare.selection import default_layers, parse_layers, prompt_ids

POLYGRAPHY = Path(sys.executable).with_name("polygraphy")


class OneTensorScaled:
    """A weight source that hands the backends one tensor of one layer scaled by `factor`."""

    def __init__(self, inner, layer: int, name: str, factor: float):
        self.inner, self.layer, self.name, self.factor = inner, layer, name, factor
        self.config = inner.config

    def globals(self, names=None):
        return self.inner.globals(names)

    def block_weights(self, layer):
        w = self.inner.block_weights(layer)
        if layer == self.layer:
            w = {**w, self.name: w[self.name] * self.factor}
        return w


def rope_one_position_ahead(cfg):
    """A feed transform: the rope tables of every block rotated by one position (cos/sin of angle + inv_freq)."""
    f = inv_freq(cfg).numpy()
    cf, sf = np.cos(f), np.sin(f)

    def transform(key, feed):
        if "rope_cos" in feed:
            c, s = feed["rope_cos"], feed["rope_sin"]
            feed["rope_cos"], feed["rope_sin"] = c * cf - s * sf, s * cf + c * sf
        return feed

    return transform


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return Checkpoint.open(tiny_ckpt)


@pytest.fixture(scope="module")
def passing(tiny_ckpt, tiny_export, tmp_path_factory):
    """`k2trt compare` run once on the tiny model, saving its polygraphy files: (save dir, exit code, stdout). The
    tests that read the files get them whichever runs first."""
    import contextlib
    import io

    save = tmp_path_factory.mktemp("compare-pass")
    args = ["compare", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--save-dir", str(save), "--tokens", "8"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args)
    return save, rc, out.getvalue()


def test_default_layers_and_parsing(ckpt):
    cfg = ckpt.config  # tiny: layer 0 dense, 1..3 MoE
    assert default_layers(cfg) == [("embedding", None), ("dense_block", 0), ("moe_block", 1), ("moe_block", 2),
                                   ("moe_block", 3), ("head", None)]
    assert parse_layers("head,2,embedding,2", cfg) == [("head", None), ("moe_block", 2), ("embedding", None)]
    with pytest.raises(Exception, match="layer index 0..3"):
        parse_layers("7", cfg)


@pytest.mark.slow
def test_compare_passes_on_tiny_and_saves_polygraphy_files(passing):
    save, rc, out = passing
    assert rc == 0
    table, last = out.strip().rsplit("\n", 1)
    assert last.startswith("compare: all") and "FAIL" not in table
    for block in ("embedding", "dense_block_0", "moe_block_1", "moe_block_2", "moe_block_3", "head"):
        assert f"\n{block} " in table
        for name in ("inputs.json", "golden.json", "model.onnx", "command.txt"):
            assert (save / block / name).is_file()
    assert "first-step logits" in table and "greedy tokens 16/16" in table


@pytest.mark.slow
def test_saved_files_recheck_with_the_polygraphy_cli(passing):
    save, _, _ = passing
    cmd = (save / "dense_block_0" / "command.txt").read_text().split()
    assert cmd[0] == "polygraphy"
    res = subprocess.run([str(POLYGRAPHY)] + cmd[1:], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "PASSED" in res.stdout


@pytest.mark.slow
def test_perturbed_moe_weight_fails_and_names_the_block(ckpt, tiny_ckpt, tiny_export, tmp_path):
    bad = OneTensorScaled(ckpt, 2, "mlp.experts.down_proj.weight_scale_inv", 1.01)
    setup = Setup(weights=ckpt, export_dir=tiny_export, prompts=prompt_ids(tiny_ckpt, None, ckpt.config),
                  layers=parse_layers("1,2", ckpt.config), tokens=2, save_dir=tmp_path, backend_weights=bad)
    report = compare(setup, log=lambda m: None)
    assert report.failed_blocks == ["moe_block_2 (ort)", "e2e (ort)"]
    failed = {(r.block, r.output) for r in report.rows if not r.passed}
    assert ("moe_block_2", "hidden_states_out") in failed
    assert ("moe_block_2", "latent_new") not in failed  # the latent is computed before the MoE
    assert "moe_block_2" in report.summary() and "moe_block_1" not in report.summary()
    # The saved files reproduce the failure outside k2trt: the golden is the true reference's.
    cmd = (tmp_path / "moe_block_2" / "command.txt").read_text().split()
    res = subprocess.run([str(POLYGRAPHY)] + cmd[1:], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "FAILED" in res.stdout


def test_wrong_rope_fails_and_names_the_blocks(ckpt, tiny_ckpt, tiny_export, tmp_path):
    setup = Setup(weights=ckpt, export_dir=tiny_export, prompts=prompt_ids(tiny_ckpt, None, ckpt.config),
                  layers=parse_layers("embedding,0,3,head", ckpt.config), tokens=0, save_dir=tmp_path,
                  feed_transform=rope_one_position_ahead(ckpt.config))
    report = compare(setup, log=lambda m: None)
    assert report.failed_blocks == ["dense_block_0 (ort)", "moe_block_3 (ort)"]
    assert report.summary() == "compare: FAILED: dense_block_0 (ort), moe_block_3 (ort)"


def test_cli_exit_code_and_last_line_on_a_damaged_graph(tiny_ckpt, tiny_export, tmp_path, capsys):
    """A wrong graph, exported as such (the head's RMSNorm epsilon 1e-6 -> 1.0, its hash recorded as an
    exporter bug would): exit 1, the block named last."""
    import onnx
    from onnx import numpy_helper

    onnx_dir = tmp_path / "onnx"
    shutil.copytree(tiny_export, onnx_dir, ignore=shutil.ignore_patterns("compare"))
    model = onnx.load(str(onnx_dir / "ort" / "head.onnx"))
    (eps,) = [i for i in model.graph.initializer if numpy_helper.to_array(i).size == 1
              and np.isclose(numpy_helper.to_array(i), ckpt_eps(tiny_ckpt))]
    eps.CopyFrom(numpy_helper.from_array(np.array(1.0, np.float32), eps.name))
    onnx.save(model, str(onnx_dir / "ort" / "head.onnx"))
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    manifest["graphs"]["ort/head"]["sha256"] = sha256_file(onnx_dir / "ort" / "head.onnx")
    (onnx_dir / "manifest.json").write_text(json.dumps(manifest))
    rc = main(["compare", "--model", str(tiny_ckpt), "--onnx", str(onnx_dir), "--layers", "0,head", "--tokens", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    assert out[-1] == "compare: FAILED: head (ort), e2e (ort)"
    assert (onnx_dir / "compare" / "head" / "golden.json").is_file()  # default --save-dir: <onnx>/compare


def ckpt_eps(model_dir):
    from k2trt.config import K2Config

    return K2Config.from_json(Path(model_dir) / "config.json").rms_norm_eps


def test_trt_backend_missing_is_one_clear_line(tiny_ckpt, tiny_export, tmp_path, capsys):
    rc = main(["compare", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--backends", "trt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--engines" in err[0]
    try:
        import tensorrt  # noqa: F401
    except (ImportError, OSError):
        rc = main(["compare", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--engines", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "TensorRT" in err[0]


@pytest.mark.slow
def test_backend_runner_matches_the_golden(passing, ckpt, tiny_export):
    """The polygraphy runner over a runtime Backend (the TensorRT route), here over OrtBackend, reproduces a golden."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.json import load_json

    from k2trt.runtime.backends.ort import OrtBackend
    from k2trt.tools.compare.polygraphy_support import BackendRunner, quiet

    save, _, _ = passing
    feeds = load_json(str(save / "moe_block_1" / "inputs.json"))
    with quiet():
        res = Comparator.run([BackendRunner(OrtBackend(tiny_export, ckpt), "moe_block", 1, name="ort-backend")],
                             data_loader=feeds)
    golden = RunResults.load(str(save / "moe_block_1" / "golden.json"))
    assert len(res["ort-backend"]) == len(golden["reference"]) == 2
    for got, want in zip(res["ort-backend"], golden["reference"]):
        for name in ("hidden_states_out", "latent_new"):
            torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(want[name]), atol=1e-4, rtol=1e-3)


def test_the_tensorrt_route_on_cpu(ckpt, tiny_ckpt, tiny_export, tmp_path):
    """The rows a TensorRT backend gets (W8A8 golden, BackendRunner, looser tolerance), with the W8A8 torch
    reference standing in for the engines: everything matches exactly."""
    from k2trt.runtime.backends.torch_reference import TorchBackend

    setup = Setup(weights=ckpt, export_dir=tiny_export, prompts=prompt_ids(tiny_ckpt, None, ckpt.config),
                  layers=parse_layers("1", ckpt.config), tokens=2, save_dir=tmp_path)
    report = compare(setup, log=lambda m: None, backends={"trt": TorchBackend(ckpt, "float32", activation_quant=1)})
    assert report.passed and {r.backend for r in report.rows} == {"trt"}
    assert all(r.max_abs == 0 for r in report.rows if r.max_abs is not None)
    assert report.rows[0].tol.endswith("/ 5e-02")  # W8A8 takes at least the bfloat16 row
    assert (tmp_path / "moe_block_1" / "trt" / "golden.json").is_file()
