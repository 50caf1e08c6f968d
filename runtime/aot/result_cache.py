"""AOT compile results kept on disk, so a configuration is compiled once per version of the code that compiles it.

A result (aot_compile.compile_one: the tiles compile_launch settled on, shared memory, ptxas' registers and
spills) depends on the launch and on nothing else but the code and tools that compile it: the kernels and the AOT
launch path (their sources, found by following their k2trt imports), Triton's version (it bundles ptxas) and a
ptxas chosen through TRITON_PTXAS_PATH. Those make the key of a folder, the launch and target the name of a file
in it, so an edit to a kernel compiles again and nothing stale is ever read.

Where: $K2TRT_AOT_CACHE, else $XDG_CACHE_HOME/k2trt/aot, else ~/.cache/k2trt/aot. Clearing it is deleting that
folder; `python -m k2trt.runtime.aot.sweep --no-cache` compiles everything and writes nothing here.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
from pathlib import Path

from k2trt.atomic import atomic_write_text

FORMAT = 1  # of a stored file (job and result): a change to its layout bumps it
# the modules a compile runs (aot_compile.compile_one, every launch class); their k2trt imports are followed
ROOTS = ("k2trt.runtime.aot.compile_one", "k2trt.runtime.aot.ptx", "k2trt.runtime.aot.linear",
         "k2trt.runtime.aot.moe", "k2trt.runtime.aot.moe_int4", "k2trt.runtime.aot.mla")


def cache_root() -> Path:
    if os.environ.get("K2TRT_AOT_CACHE"):
        return Path(os.environ["K2TRT_AOT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k2trt" / "aot"


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _k2trt_imports(path: Path) -> set[str]:
    """The k2trt modules a source file imports, anywhere in it (function-level imports included; the project
    imports absolutely)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("k2trt")}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            base = node.module or ""
            if base.startswith("k2trt"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def source_files(roots=ROOTS) -> list[Path]:
    """Every k2trt source file the roots import, directly or not (packages' __init__ included)."""
    seen: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue  # `from module import function`: the name after the module is no module
        seen[name] = path
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += parents + sorted(_k2trt_imports(path))
    return sorted(set(seen.values()))


def fingerprint(roots=ROOTS) -> str:
    """What every result depends on besides its launch: the sources, Triton's version, the ptxas it runs."""
    import triton

    h = hashlib.sha256(f"format {FORMAT}; triton {triton.__version__}; "
                       f"ptxas {os.environ.get('TRITON_PTXAS_PATH', 'bundled')}\n".encode())
    package_root = Path(importlib.util.find_spec("k2trt").origin).parent.parent
    for path in source_files(roots):
        try:
            shown = path.relative_to(package_root)
        except ValueError:
            shown = path.name
        h.update(f"{shown}\n".encode() + path.read_bytes() + b"\n")
    return h.hexdigest()[:20]


class ResultCache:
    """Results stored one file per launch and target, under the code's fingerprint: written whole (a reader never
    sees half a file, and runs side by side may write the same result), read only when it parses."""

    def __init__(self, root: Path | None = None, key: str | None = None):
        self.folder = (root or cache_root()) / (key or fingerprint())

    def _path(self, job: tuple) -> Path:
        name = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:32]
        return self.folder / f"{name}.json"

    def get(self, job: tuple) -> dict | None:
        try:
            stored = json.loads(self._path(job).read_text())
        except (OSError, ValueError):
            return None
        return stored.get("result") if stored.get("job") == json.loads(json.dumps(job)) else None

    def put(self, job: tuple, result: dict) -> None:
        try:
            atomic_write_text(self._path(job), json.dumps({"job": job, "result": result}))
        except OSError:
            pass  # a read-only or full disk: the result stands, the next run compiles again
