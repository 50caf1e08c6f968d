"""The polygraphy files `k2trt compare` leaves per block: inputs.json (the feeds), golden.json (the reference's
RunResults), and — for a backend whose graph runs on ONNX Runtime alone — model.onnx with the layer's weights
stored in it and command.txt, the plain `polygraphy run` that re-checks it without k2trt."""

from __future__ import annotations

from pathlib import Path

import onnx


def save_case(case, out_dir: Path) -> None:
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    from k2trt.tools.compare.polygraphy_support import quiet

    out_dir.mkdir(parents=True, exist_ok=True)
    golden = RunResults()
    golden.add(case.outputs, runner_name="reference")
    with quiet():
        save_json(case.feeds, str(out_dir / "inputs.json"))
        golden.save(str(out_dir / "golden.json"))


def save_model(model: onnx.ModelProto, out_dir: Path) -> Path:
    path = out_dir / "model.onnx"
    big = sum(len(t.raw_data) for t in model.graph.initializer) > (1 << 30)  # protobuf stops at 2 GiB
    onnx.save_model(model, str(path), save_as_external_data=big, location="model.onnx.data")
    return path


def write_command(out_dir: Path, atol: dict, rtol: float) -> None:
    tol = lambda d: " ".join(f"{n}:{v:.6g}" for n, v in d.items())  # noqa: E731
    (out_dir / "command.txt").write_text(
        f"polygraphy run {out_dir}/model.onnx --onnxrt --load-inputs {out_dir}/inputs.json "
        f"--load-outputs {out_dir}/golden.json --atol {tol(atol)} --rtol {tol({n: rtol for n in atol})}\n")
