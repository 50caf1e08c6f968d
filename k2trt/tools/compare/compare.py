"""`k2trt compare`: each backend against the torch reference, through polygraphy, block by block and end to end.

Golden inputs and outputs come from the reference's real activations on fixed prompts: the reference generates
through the runtime's own generator, and a recording wrapper keeps what the chosen blocks receive and return in
the prefill step (T > 1, empty cache) and the first decode step (T = 1, reading a non-empty cache) (golden.py).
Each backend gets the golden of the FP8 convention it computes in (Backend.activation_quant: the ONNX Runtime
graphs compute W8A16, the TensorRT engines W8A8) and the tolerance of its dtype (tolerance.py); block rows come
from blocks.py, end-to-end rows from e2e.py, the table from table.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k2trt.errors import K2Error
from k2trt.export.block_graphs import activation_io, paged_io
from k2trt.export.trt_form import attends
from k2trt.runtime.backends.factory import BackendChoice, open_backend
from k2trt.tools.compare.per_block import FeedTransform, block_rows
from k2trt.tools.compare.e2e import e2e_rows
from k2trt.tools.compare.golden import capture
from k2trt.tools.compare.selection import Block, default_layers
from k2trt.tools.compare.table import Report, Row
from k2trt.tools.compare.tolerance import tolerance

DEFAULT_TOKENS = 16


@dataclass
class Setup:
    weights: object  # the reference's weight source (a Checkpoint, or RandomWeights)
    export_dir: Path
    prompts: list[list[int]]
    backends: tuple[BackendChoice, ...] = ()  # default: ONNX Runtime over export_dir
    layers: list[Block] | None = None  # default_layers()
    tokens: int = DEFAULT_TOKENS  # greedy steps of the end-to-end rows; 0 = no end-to-end rows
    save_dir: Path | None = None  # default <export_dir>/compare
    # Fault-injection hooks (tests): the weight source the backends bind (default: `weights`), and a transform of
    # the activation feeds a backend receives in the block rows (the saved golden files are never transformed).
    backend_weights: object = None
    feed_transform: FeedTransform | None = None

    def choices(self) -> tuple[BackendChoice, ...]:
        return self.backends or (BackendChoice("ort", onnx=Path(self.export_dir)),)


def check_export(setup: Setup, cfg) -> None:
    from k2trt.export_manifest import check_matches, read_manifest

    manifest = read_manifest(Path(setup.export_dir))
    check_matches(manifest, cfg, str(setup.export_dir))
    for key, entry in manifest["graphs"].items():
        acts = [i["name"] for i in entry["inputs"] if i["name"] not in entry["weights"]]
        paged = entry["form"] == "tensorrt" and attends(entry["kind"])  # the pool read in place
        want = [n for n, _, _ in (paged_io if paged else activation_io)(cfg, entry["kind"], manifest["act_dtype"])[0]]
        if acts != want:
            raise K2Error(f"{setup.export_dir}: graph {key} has activation inputs {acts}; re-export with this version")


def compare(setup: Setup, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
            backends: dict | None = None) -> Report:
    """Every row of the table. `backends` (name -> Backend) replaces the ones setup.backends names."""
    from k2trt.runtime.backends.torch_reference import TorchBackend

    cfg = setup.weights.config
    check_export(setup, cfg)
    layers = setup.layers or default_layers(cfg)
    if backends is None:
        weights = setup.backend_weights if setup.backend_weights is not None else setup.weights
        backends = {c.name: open_backend(c, weights) for c in setup.choices()}  # fail early on a missing one
    save_root = Path(setup.save_dir or Path(setup.export_dir) / "compare")
    goldens: dict[tuple, object] = {}
    rows: list[Row] = []
    for name, backend in backends.items():
        aq = backend.activation_quant
        key = (aq, backend.reads_pages)  # its FP8 convention, and the cache form it takes
        if key not in goldens:
            log(f"compare: reference run (activation_quant={aq}{', pages' if key[1] else ''}) on "
                f"{len(setup.prompts)} prompt(s)")
            goldens[key] = capture(TorchBackend(setup.weights, "float32", aq), cfg, setup.prompts, layers,
                                   setup.tokens, paged=key[1])
        tol = tolerance(backend.act_dtype, aq)
        log(f"compare: {name}: {len(layers)} blocks")
        rows += block_rows(name, backend, goldens[key], save_root, tol, setup.feed_transform,
                           _providers(setup, name))
        if setup.tokens:
            log(f"compare: {name}: end to end, {setup.tokens} greedy tokens")
            rows += e2e_rows(name, backend, goldens[key], cfg, tol)
    return Report(rows)


def _providers(setup: Setup, name: str) -> list[str] | None:
    return next((list(c.providers) for c in setup.choices() if c.name == name), None)
