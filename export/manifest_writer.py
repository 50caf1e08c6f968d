"""manifest.json of an export directory, written: what each graph is, its I/O, which layers use it, how to prepare its
weights — everything the runtime and the engine builder need, so neither re-derives it."""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path

import onnx

import k2trt
from k2trt.atomic import atomic_path
from k2trt.export_manifest import FORMAT, graph_path, read_manifest
from k2trt.files import sha256_file, write_json
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS
from k2trt.export.block_graphs import IR_VERSION, OPSET
from k2trt.export.onnx_ops import dims
from k2trt.dtypes import BY_ONNX

# The modules whose code decides what the graphs contain: a change to any of them makes old graphs stale.
GRAPH_SOURCES = ("k2trt.dtypes", "k2trt.graphs.blocks", "k2trt.graphs.contracts", "k2trt.graphs.weights",
                 "k2trt.graphs.weight_prep", "k2trt.export.onnx_ops", "k2trt.export.block_graphs",
                 "k2trt.export.lower_ort", "k2trt.export.split_moe", "k2trt.export.checks", "k2trt.export.exporter",
                 "k2trt.graphs.eagle", "k2trt.export.draft_graphs")


@functools.lru_cache(maxsize=1)
def exporter_fingerprint() -> str:
    h = hashlib.sha256()
    for name in GRAPH_SOURCES:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()[:16]


DIMS = {"B": "batch", "T": "new positions this step", "P": "cache slots, read in place (masked beyond the past)",
        "P+T": "keys: the P cache slots then the T new positions"}


def _io(values) -> list[dict]:
    out = []
    for vi in values:
        tt = vi.type.tensor_type
        out.append({"name": vi.name, "dtype": BY_ONNX[tt.elem_type].name, "shape": dims(tt)})
    return out


def write_graph(out: Path, key: str, kind: str, form: str, model: onnx.ModelProto, prep: dict,
                activation_quant: int, activation_names: set[str]) -> dict:
    """Save one graph atomically and describe it; every input not in activation_names is a weight."""
    path = out / f"{key}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        onnx.save_model(model, str(tmp))
    inputs = _io(model.graph.input)
    return {
        "form": form,
        "kind": kind,
        "file": f"{key}.onnx",
        "sha256": sha256_file(path),
        "nodes": len(model.graph.node),
        "activation_quant": activation_quant,
        "inputs": inputs,
        "outputs": _io(model.graph.output),
        "weights": [i["name"] for i in inputs if i["name"] not in activation_names],
        "prep": prep,
    }


def make_manifest(cfg: K2Config, act_dtype: str, activation_quant: int, graphs: dict,
                  expert_ranges: int = 1, expert_parallel: int = 1, draft: dict | None = None) -> dict:
    layers = {kind: [] for kind in BLOCK_KINDS}
    for i in range(cfg.num_hidden_layers):
        layers[cfg.layer_kind(i)].append(i)
    if expert_parallel > 1:  # the MoE blocks' parts serve the MoE layers
        layers.update({kind: list(layers["moe_block"]) for kind in MOE_PART_KINDS})
    return {
        "format": FORMAT,
        "exporter_version": k2trt.__version__,
        "exporter_fingerprint": exporter_fingerprint(),
        "config_fingerprint": cfg.fingerprint(),
        "config": cfg.to_hf_dict(),
        "act_dtype": act_dtype,
        "activation_quant": activation_quant,
        "expert_ranges": expert_ranges,
        "expert_parallel": expert_parallel,
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "dims": DIMS,
        "layers": layers,
        "graphs": graphs,
        **({"draft": draft} if draft is not None else {}),  # an EAGLE-3 draft's graphs are among them
    }


def write_manifest(out: Path, manifest: dict) -> None:
    write_json(out / "manifest.json", manifest)


def load_if_current(out: Path, cfg: K2Config, act_dtype: str, activation_quant: int,
                    expert_ranges: int = 1, expert_parallel: int = 1) -> dict | None:
    """The existing manifest if it was written for the same config, dtype, mode, expert ranges, expert parallelism
    and exporter code."""
    try:
        m = read_manifest(out)
    except K2Error:
        return None
    same = (m.get("config_fingerprint") == cfg.fingerprint() and m.get("act_dtype") == act_dtype
            and m.get("activation_quant") == activation_quant and m.get("expert_ranges", 1) == expert_ranges
            and m.get("expert_parallel", 1) == expert_parallel
            and m.get("exporter_version") == k2trt.__version__
            and m.get("exporter_fingerprint") == exporter_fingerprint())
    return m if same else None


def entry_is_current(out: Path, entry: dict | None) -> bool:
    if not entry:
        return False
    path = graph_path(out, entry)
    return path.exists() and sha256_file(path) == entry["sha256"]
