"""manifest.json of an export directory, as its readers see it (the runtime's backends, the engine builder): its
shape, checked before anything is read, and the graph files it names, checked against their hashes. The writer is
k2trt.export.manifest_writer; this module sits below both, so the runtime never imports the exporter."""

from __future__ import annotations

from pathlib import Path

from k2trt.config import K2Config
from k2trt.dtypes import DTYPES
from k2trt.errors import K2Error
from k2trt.files import member, read_json_object, sha256_file
from k2trt.schema import ListOf, MapOf, check

FORMAT = "k2trt-export/2"  # 2: TensorRT graphs read the pool in place, a prefill form per attention kind

# What the runtime and the engine builder read from a manifest; read_manifest checks it all before they do.
IO_SCHEMA = ListOf({"name": str, "dtype": str, "shape": ListOf((str, int))})
GRAPH_SCHEMA = {"form": str, "kind": str, "file": str, "sha256": str, "inputs": IO_SCHEMA, "outputs": IO_SCHEMA,
                "weights": ListOf(str), "prep": MapOf({"op": str, "from": ListOf(str)})}
SCHEMA = {"config_fingerprint": str, "config": dict, "act_dtype": str, "activation_quant": int,
          "layers": MapOf(ListOf(int)), "graphs": MapOf(GRAPH_SCHEMA)}


# A weight input holding experts [first, stop) of a stacked expert tensor (export/split_moe.py, expert ranges): the
# runtime binds it as that slice of the stacked tensor (runtime/backends/graph_weights.py), a view, no copy.
EXPERT_RANGE_SEP = "@"


def expert_range_input(stacked: str, first: int, stop: int) -> str:
    return f"{stacked}{EXPERT_RANGE_SEP}{first}:{stop}"


def parse_expert_range(name: str) -> tuple[str, int, int] | None:
    """(stacked name, first, stop) of an expert-range weight input; None for any other name."""
    stacked, sep, span = name.rpartition(EXPERT_RANGE_SEP)
    first, colon, stop = span.partition(":")
    if not sep or not colon or not first.isdigit() or not stop.isdigit():
        return None
    return stacked, int(first), int(stop)


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


def check_matches(manifest: dict, cfg: K2Config, where: str) -> None:
    """Refuse graphs exported for another config."""
    if manifest["config_fingerprint"] != cfg.fingerprint():
        raise K2Error(f"{where}: the graphs were exported for another config "
                      f"(fingerprint {manifest['config_fingerprint']}, checkpoint {cfg.fingerprint()}); re-export")


def check_expert_parallel_export(manifest: dict, expert_parallel: int, where: str) -> None:
    """Refuse to run --expert-parallel E on graphs (or engines built from graphs) not exported for it: the experts
    graph holds 1/E of the routed experts."""
    exported = manifest.get("expert_parallel", 1)
    if exported != expert_parallel:
        have = f"for --expert-parallel {exported}" if exported > 1 else "without --expert-parallel"
        raise K2Error(f"{where}: exported {have}; --expert-parallel {expert_parallel} needs graphs from "
                      f"`k2trt export --expert-parallel {expert_parallel}` (and engines built from them)")
