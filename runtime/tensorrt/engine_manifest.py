"""manifest.json of an engine directory, and the checks made before engines are loaded.

A serialized TensorRT engine runs only under the TensorRT version that built it and on GPUs of the compute
capability it was built for; it also bakes in the graph it was parsed from. The manifest records all three
(plus the profiles and the graph I/O), and `load_engine_manifest` refuses a mismatch with one clear line instead of
TensorRT's deserialization failure. TensorRT itself is imported lazily here and nowhere at module level.
"""

from __future__ import annotations

from pathlib import Path

import k2trt
from k2trt.files import member, read_json_object, sha256_file, write_json
from k2trt.errors import K2Error
from k2trt.export_manifest import GRAPH_SCHEMA, IO_SCHEMA
from k2trt.schema import ListOf, MapOf, check
from k2trt.runtime.tensorrt.environment import current_environment, max_ptx_for_cuda, ptx_text
from k2trt.runtime.tensorrt.profiles import Profile, ProfileSpec

FORMAT = "k2trt-engines/2"  # 2: paged attention engines, a prefill form per attention kind


class EngineMismatch(K2Error):
    """Engines built for another TensorRT, GPU, export or config than the one at hand."""


# ---- writing ---------------------------------------------------------------------------------------------

def engine_entry(kind: str, graph: dict, profiles: list[Profile], engine_file: str, engine_sha256: str,
                 plugin_modes: dict[str, str]) -> dict:
    """One engine's record: its source graph (by hash), profiles, the graph I/O the runtime binds, and how its
    weight inputs are prepared from the checkpoint's tensors (the graph's prep: upload_weights reads it)."""
    return {
        "kind": kind,
        "file": engine_file,
        "sha256": engine_sha256,
        "source": graph["file"],
        "source_sha256": graph["sha256"],
        "profiles": [p.as_dict() for p in profiles],
        "inputs": graph["inputs"],
        "outputs": graph["outputs"],
        "weights": graph["weights"],
        "prep": graph["prep"],
        "plugins": plugin_modes,
        **({"dispatch": graph["dispatch"]} if "dispatch" in graph else {}),  # an experts engine's rows
    }


def make_engine_manifest(export_manifest: dict, spec: ProfileSpec, env: dict, engines: dict,
                         ptx_version: int | None = None) -> dict:
    """ptx_version: the PTX ISA the AOT kernels carry (90 = 9.0), None without AOT plugins."""
    return {
        "format": FORMAT,
        "k2trt_version": k2trt.__version__,
        "tensorrt_version": env["tensorrt_version"],
        "gpu": {"name": env["gpu_name"], "compute_capability": env["compute_capability"]},
        "cuda_driver": env.get("cuda_driver"),
        "ptx_version": ptx_version,
        "config_fingerprint": export_manifest["config_fingerprint"],
        "config": export_manifest["config"],
        "act_dtype": export_manifest["act_dtype"],
        "activation_quant": export_manifest.get("activation_quant"),
        "layers": export_manifest["layers"],
        "expert_parallel": export_manifest.get("expert_parallel", 1),
        "profile_spec": spec.as_dict(),
        "engines": engines,
        **({"draft": export_manifest["draft"]} if "draft" in export_manifest else {}),  # its engines are among them
    }


def write_engine_manifest(engine_dir: Path, manifest: dict) -> None:
    write_json(Path(engine_dir) / "manifest.json", manifest)


# ---- loading ---------------------------------------------------------------------------------------------

ENGINE_SCHEMA = {"kind": str, "file": str, "sha256": str, "source": str, "source_sha256": str, "profiles": ListOf(dict),
                 "inputs": IO_SCHEMA, "outputs": IO_SCHEMA, "weights": ListOf(str), "prep": GRAPH_SCHEMA["prep"],
                 "plugins": MapOf(str)}
SCHEMA = {"tensorrt_version": str, "gpu": {"name": str, "compute_capability": str}, "config_fingerprint": str,
          "act_dtype": str, "activation_quant": (int, type(None)), "layers": MapOf(ListOf(int)),
          "profile_spec": dict, "engines": MapOf(ENGINE_SCHEMA)}


class DamagedEngineManifest(K2Error):
    def __init__(self, message: str):
        super().__init__(f"{message} (damaged; rebuild with `k2trt build`)")


def read_engine_manifest(engine_dir: Path) -> dict:
    path = Path(engine_dir) / "manifest.json"
    m = read_json_object(path, "build the engines with `k2trt build`")
    if m.get("format") != FORMAT:
        raise K2Error(f"{path}: format {m.get('format')!r} is not {FORMAT!r} (rebuild with this version)")
    check(m, SCHEMA, str(path), DamagedEngineManifest)
    for kind, entry in m["engines"].items():
        member(Path(engine_dir), entry["file"], f"{path}: engine {kind}", DamagedEngineManifest)
    return m


def check_ptx(manifest: dict, env: dict, where: str) -> None:
    """AOT plugins carry PTX that the driver JIT-compiles when the engine is loaded: it must know that PTX ISA."""
    ptx, driver = manifest.get("ptx_version"), env.get("cuda_driver")
    if ptx is None or driver is None:
        return
    major, minor = (int(v) for v in driver.split("."))
    limit = max_ptx_for_cuda(major, minor)
    if ptx > limit:
        raise EngineMismatch(f"{where}: the engines' AOT kernels are PTX {ptx_text(ptx)}, this driver "
                             f"(CUDA {driver}) loads up to {ptx_text(limit)}; "
                             "rebuild them here or update the driver")


def check_environment(manifest: dict, env: dict, where: str) -> None:
    built, here = manifest["tensorrt_version"], env["tensorrt_version"]
    if built != here:
        raise EngineMismatch(f"{where}: engines were built with TensorRT {built}, this is TensorRT {here}; "
                             "rebuild them with `k2trt build`")
    built_cc, here_cc = manifest["gpu"]["compute_capability"], env["compute_capability"]
    if built_cc != here_cc:
        raise EngineMismatch(f"{where}: engines were built for compute capability {built_cc} "
                             f"({manifest['gpu']['name']}), this GPU is {here_cc} ({env['gpu_name']}); "
                             "rebuild them on this GPU")
    check_ptx(manifest, env, where)


def check_export(manifest: dict, export_manifest: dict, where: str) -> None:
    if manifest["config_fingerprint"] != export_manifest["config_fingerprint"]:
        raise EngineMismatch(f"{where}: engines were built for config {manifest['config_fingerprint']}, the export "
                             f"directory has {export_manifest['config_fingerprint']}; rebuild the engines")
    if manifest["act_dtype"] != export_manifest["act_dtype"]:
        raise EngineMismatch(f"{where}: engines compute in {manifest['act_dtype']}, the export directory in "
                             f"{export_manifest['act_dtype']}; rebuild the engines")
    for kind, entry in manifest["engines"].items():
        graph = export_manifest["graphs"].get(f"trt/{kind}")
        if graph is None:
            raise EngineMismatch(f"{where}: the export directory has no trt/{kind} graph")
        if graph["sha256"] != entry["source_sha256"]:
            raise EngineMismatch(f"{where}: {kind}.engine was built from another {graph['file']} "
                                 f"(sha256 {entry['source_sha256'][:12]}…, now {graph['sha256'][:12]}…); "
                                 "rebuild the engines")


def check_engine_files(manifest: dict, engine_dir: Path) -> None:
    for kind, entry in manifest["engines"].items():
        path = Path(engine_dir) / entry["file"]  # a plain member name: read_engine_manifest checked it
        if not path.exists():
            raise K2Error(f"{engine_dir}: {entry['file']} is missing (rebuild with `k2trt build`)")
        if sha256_file(path) != entry["sha256"]:
            raise EngineMismatch(f"{path}: does not match its manifest (a partial copy or another build); rebuild")


def load_engine_manifest(engine_dir: str | Path, export_manifest: dict | None = None,
                         env: dict | None = None) -> dict:
    """The engine manifest, after checking it against this TensorRT and GPU (`env`, default: the running ones),
    the engine files, and — when given — the export directory's manifest."""
    engine_dir = Path(engine_dir)
    m = read_engine_manifest(engine_dir)
    check_environment(m, current_environment() if env is None else env, str(engine_dir))
    if export_manifest is not None:
        check_export(m, export_manifest, str(engine_dir))
    check_engine_files(m, engine_dir)
    return m


def profile_spec_of(manifest: dict) -> ProfileSpec:
    return ProfileSpec(**manifest["profile_spec"])
