"""The layers import one way: base -> config -> graphs -> checkpoint files -> export manifests -> export -> runtime
(kernels -> AOT -> backend contract -> TensorRT -> engine build -> backends -> text -> cache -> generation ->
distributed -> serve -> entrypoints) -> tiny -> tools -> commands.

Every import of a k2trt module anywhere in a file (module level or inside a function) is an edge; an edge from a
lower layer to a higher one fails, naming the file and the import. Every module must belong to a layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> folder, as pyproject.toml maps them
FOLDERS = {"k2trt": "k2trt", "k2trt.graphs": "graphs", "k2trt.export": "export", "k2trt.runtime": "runtime"}

# (layer, module prefixes), lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS = [
    ("base", ["k2trt", "k2trt.errors", "k2trt.files", "k2trt.atomic", "k2trt.dtypes", "k2trt.schema", "k2trt.args",
              "k2trt.dirlock"]),
    ("config", ["k2trt.config", "k2trt.quantization", "k2trt.draft_config"]),
    ("graphs", ["k2trt.graphs"]),
    ("checkpoint", ["k2trt.safetensors_io", "k2trt.checkpoint", "k2trt.checkpoint_writer", "k2trt.hub",
                    "k2trt.draft"]),
    ("artifacts", ["k2trt.export_manifest"]),
    ("export", ["k2trt.export"]),
    # the runtime's rooms, one way too: kernels, their ahead-of-time compilation, the backend contract, what
    # TensorRT's build and run share (environment, plugins, profiles, the engine manifest), the engine build (and
    # the AOT sweep, which compiles what the exported graphs ask for), the backends and their factory, text, the latent
    # cache, the step loop, pipeline stages and expert-parallel ranks, the server, what the commands call
    ("runtime.kernels", ["k2trt.runtime", "k2trt.runtime.kernels"]),
    ("runtime.aot", ["k2trt.runtime.aot"]),
    ("runtime.contract", ["k2trt.runtime.backends.contract", "k2trt.runtime.backends.graph_weights"]),
    ("runtime.tensorrt", ["k2trt.runtime.tensorrt"]),
    ("runtime.engines", ["k2trt.runtime.engines", "k2trt.runtime.aot.sweep"]),
    ("runtime.backends", ["k2trt.runtime.backends"]),
    ("runtime.text", ["k2trt.runtime.text"]),
    ("runtime.cache", ["k2trt.runtime.cache"]),
    ("runtime.generation", ["k2trt.runtime.generation"]),
    ("runtime.distributed", ["k2trt.runtime.distributed"]),
    ("runtime.serve", ["k2trt.runtime.serve"]),
    ("runtime.entrypoints", ["k2trt.runtime.entrypoints"]),
    # the embedded tiny checkpoint's makers (tests and benches import them), benches and reports, and on top the
    # commands: one module per `k2trt` subcommand, and the CLI that finds them
    ("tiny", ["k2trt.tiny"]),
    ("tools", ["k2trt.tools"]),
    ("commands", ["k2trt.commands", "k2trt.cli"]),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str | None:
    best = None
    for name, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                # the bare package "k2trt" only claims itself, not its subpackages
                if p == "k2trt" and module != "k2trt":
                    continue
                best = (name, p)
    return best and best[0]


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from k2trt.x import y` may import the submodule k2trt.x.y: count the deepest existing one
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names] + [(node.lineno, node.module)]
    return [(line, name) for line, name in found if name == "k2trt" or name.startswith("k2trt.")]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules without a layer: {unplaced}"


def back_edges(known: dict[str, Path]) -> list[str]:
    back = []
    for module, path in known.items():
        mine = RANK[layer_of(module)]
        for line, name in imports(path):
            if name not in known:  # `from k2trt.x import function`: the edge is to k2trt.x, listed separately
                continue
            if RANK[layer_of(name)] > mine:
                back.append(f"{path}:{line} ({layer_of(module)}) imports {name} ({layer_of(name)})")
    return back


def test_imports_go_one_way():
    back = back_edges(modules())
    assert not back, "imports against the layers:\n" + "\n".join(back)


def test_a_back_edge_is_caught(tmp_path):
    """The check itself: a graphs module importing the runtime inside a function is reported."""
    planted = tmp_path / "oops.py"
    planted.write_text("def f():\n    from k2trt.runtime.generation.generator import Generator\n")
    back = back_edges({**modules(), "k2trt.graphs.oops": planted})
    assert back == [f"{planted}:2 (graphs) imports k2trt.runtime.generation.generator (runtime.generation)"]
