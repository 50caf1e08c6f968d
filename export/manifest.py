"""manifest.json of an export directory: what each graph is, its I/O, which layers use it, how to prepare its
weights — everything the runtime and the engine builder need, so neither re-derives it."""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path

import onnx

import k2trt
from k2trt.atomic import atomic_path
from k2trt.files import member, read_json_object, sha256_file, write_json
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.export.block_graphs import IR_VERSION, KINDS, OPSET
from k2trt.export.onnx_ops import dims
from k2trt.dtypes import BY_ONNX, DTYPES
from k2trt.schema import ListOf, MapOf, check

FORMAT = "k2trt-export/1"

# The modules whose code decides what the graphs contain: a change to any of them makes old graphs stale.
GRAPH_SOURCES = ("k2trt.dtypes", "k2trt.graphs.blocks", "k2trt.graphs.contracts", "k2trt.graphs.weights",
                 "k2trt.graphs.weight_prep", "k2trt.export.onnx_ops", "k2trt.export.block_graphs",
                 "k2trt.export.lower_ort", "k2trt.export.split_moe", "k2trt.export.checks", "k2trt.export.exporter")


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


def make_manifest(cfg: K2Config, act_dtype: str, activation_quant: int, graphs: dict) -> dict:
    layers = {kind: [] for kind in KINDS}
    for i in range(cfg.num_hidden_layers):
        layers[cfg.layer_kind(i)].append(i)
    return {
        "format": FORMAT,
        "exporter_version": k2trt.__version__,
        "exporter_fingerprint": exporter_fingerprint(),
        "config_fingerprint": cfg.fingerprint(),
        "config": cfg.to_hf_dict(),
        "act_dtype": act_dtype,
        "activation_quant": activation_quant,
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "dims": DIMS,
        "layers": layers,
        "graphs": graphs,
    }


def write_manifest(out: Path, manifest: dict) -> None:
    write_json(out / "manifest.json", manifest)


# What the runtime and the engine builder read from a manifest; read_manifest checks it all before they do.
IO_SCHEMA = ListOf({"name": str, "dtype": str, "shape": ListOf((str, int))})
GRAPH_SCHEMA = {"form": str, "kind": str, "file": str, "sha256": str, "inputs": IO_SCHEMA, "outputs": IO_SCHEMA,
                "weights": ListOf(str), "prep": MapOf({"op": str, "from": ListOf(str)})}
SCHEMA = {"config_fingerprint": str, "config": dict, "act_dtype": str, "activation_quant": int,
          "layers": MapOf(ListOf(int)), "graphs": MapOf(GRAPH_SCHEMA)}


class DamagedManifest(K2Error):
    def __init__(self, message: str):
        super().__init__(f"{message} (damaged; re-export)")


def read_manifest(export_dir: Path) -> dict:
    path = Path(export_dir) / "manifest.json"
    m = read_json_object(path, "run `k2trt export` first")
    if m.get("format") != FORMAT:
        raise K2Error(f"{path}: format {m.get('format')!r} is not {FORMAT!r} (re-export with this version)")
    check(m, SCHEMA, str(path), DamagedManifest)
    if m["act_dtype"] not in DTYPES:
        raise DamagedManifest(f"{path}: act_dtype {m['act_dtype']!r} is not a dtype")
    for key, entry in m["graphs"].items():
        graph_path(export_dir, entry, f"{path}: graph {key}")  # a file named there must lie inside the directory
    return m


def graph_path(export_dir: Path, entry: dict, where: str = "manifest.json") -> Path:
    return member(Path(export_dir), entry["file"], where, DamagedManifest)


def graph_file(export_dir: Path, manifest: dict, key: str) -> Path:
    """The file of graph `key`, checked against the manifest's hash (a damaged export fails here, clearly)."""
    entry = manifest["graphs"].get(key)
    if entry is None:
        raise K2Error(f"{export_dir}: the manifest has no graph {key} (re-export)")
    path = graph_path(export_dir, entry)
    if not path.exists():
        raise K2Error(f"{path}: missing (re-export)")
    if sha256_file(path) != entry["sha256"]:
        raise K2Error(f"{path}: changed since export (sha256 differs from the manifest); re-export")
    return path


def load_if_current(out: Path, cfg: K2Config, act_dtype: str, activation_quant: int) -> dict | None:
    """The existing manifest if it was written for the same config, dtype, mode and exporter code."""
    try:
        m = read_manifest(out)
    except K2Error:
        return None
    same = (m.get("config_fingerprint") == cfg.fingerprint() and m.get("act_dtype") == act_dtype
            and m.get("activation_quant") == activation_quant and m.get("exporter_version") == k2trt.__version__
            and m.get("exporter_fingerprint") == exporter_fingerprint())
    return m if same else None


def entry_is_current(out: Path, entry: dict | None) -> bool:
    if not entry:
        return False
    path = graph_path(out, entry)
    return path.exists() and sha256_file(path) == entry["sha256"]


def check_matches(manifest: dict, cfg: K2Config, where: str) -> None:
    """Refuse graphs exported for another config."""
    if manifest["config_fingerprint"] != cfg.fingerprint():
        raise K2Error(f"{where}: the graphs were exported for another config "
                      f"(fingerprint {manifest['config_fingerprint']}, checkpoint {cfg.fingerprint()}); re-export")
