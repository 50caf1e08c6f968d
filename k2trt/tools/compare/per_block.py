"""Block rows: each chosen block's golden feeds through a backend, judged output by output.

A backend whose graph runs on ONNX Runtime alone (Backend.standalone_onnx) is run by polygraphy's own
OnnxrtRunner over that graph, and its files land in <save-dir>/<block>/ with a command.txt that re-checks them
without k2trt; any other backend runs through BackendRunner and its files land in <save-dir>/<block>/<backend>/."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from k2trt.tools.compare.files import save_case, save_model, write_command
from k2trt.tools.compare.judge import compare_outputs, thresholds
from k2trt.tools.compare.table import Row

# A feed transform sees (block key, activation feed dict) and returns the dict the backend is given: the hook
# for injecting input faults (tests) without touching the golden files.
FeedTransform = Callable[[str, dict], dict]


def _onnxrt_results(model, out_dir: Path, feeds: list[dict], providers):
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    from k2trt.tools.compare.polygraphy_support import ort_session, quiet

    runner = OnnxrtRunner(functools.partial(ort_session, str(save_model(model, out_dir)), providers), name="onnxrt")
    with quiet():
        return Comparator.run([runner], data_loader=feeds)


def _backend_results(backend, case, feeds: list[dict], name: str):
    from polygraphy.comparator import Comparator

    from k2trt.tools.compare.polygraphy_support import BackendRunner, quiet

    with quiet():
        return Comparator.run([BackendRunner(backend, case.kind, case.layer, name=name)], data_loader=feeds)


def block_rows(name: str, backend, golden, save_root: Path, tol: tuple[float, float],
               feed_transform: FeedTransform | None = None, providers: list[str] | None = None) -> list[Row]:
    rows = []
    for case in golden.cases.values():
        model = backend.standalone_onnx(case.kind, case.layer)
        out_dir = save_root / case.key if model is not None else save_root / case.key / name
        save_case(case, out_dir)
        feeds = case.feeds
        if feed_transform is not None:
            feeds = [feed_transform(case.key, dict(f)) for f in feeds]
        if model is not None:
            results = _onnxrt_results(model, out_dir, feeds, providers)
            del model
            write_command(out_dir, thresholds(case.outputs, tol[0])[1], tol[1])
        else:
            results = _backend_results(backend, case, feeds, name)
        rows += compare_outputs(case.key, name, case.outputs, results, tol)
    return rows
