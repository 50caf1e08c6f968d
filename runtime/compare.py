"""`k2trt compare`: each backend against the torch reference, through polygraphy, block by block and end to end.

Block rows: golden inputs/outputs come from the reference's real activations on fixed prompts: the reference
generates through the runtime's own generator (left-padded batch, masks, rope tables, latent cache) and a
recording wrapper keeps what the chosen blocks receive and return in the prefill step (T > 1, empty cache) and the
first decode step (T = 1, reading a non-empty cache). They are saved as polygraphy files under --save-dir
(default <onnx>/compare/<block>/: inputs.json, golden.json, model.onnx = the ORT graph with that layer's
prepared weights bound, command.txt = the plain `polygraphy run` that re-checks it), then each backend runs the
same feeds through a polygraphy runner and `Comparator.compare_accuracy` judges every output.
End-to-end rows: the chained backend in runtime.generator against the reference — first-step logits, and greedy
token agreement over --tokens steps.

The ORT graphs compute W8A16 (weights dequantized), so their golden is the reference with activation_quant=0; the
TensorRT-bound graphs compute W8A8 (activation_quant from the manifest), so they get their own golden.

Tolerances, per output, by the dtype the graph computes in (polygraphy "elemwise": an element fails only if it
exceeds BOTH; atol is scaled by the output's own size, max |ref| over the golden feeds):

    graph dtype   atol              rtol    why
    float32       1e-4 * max|ref|   1e-3    float32 graph vs float32 reference: only summation order differs
    float16       1e-3 * max|ref|   1e-2    10-bit mantissa, rounded at every op
    bfloat16      1e-2 * max|ref|   5e-2    8-bit mantissa, rounded at every op
    W8A8 forms take at least the bfloat16 row: activations are rounded to FP8 per 128-group (3-bit mantissa), and
    a value on a rounding boundary may round the other way than in the reference.

The end-to-end logits use the same table; greedy tokens must agree, except that a divergence where the
reference's two candidates are within the logits' atol (a near-tie) passes and is marked "near-tie".
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from k2trt.errors import K2Error
from k2trt.runtime.generator import Generator
from k2trt.runtime.golden import Recorder, capture
from k2trt.runtime.polygraphy_support import ACTIVATIONS

TOLERANCES = {"float32": (1e-4, 1e-3), "float16": (1e-3, 1e-2), "bfloat16": (1e-2, 5e-2)}
W8A8_FLOOR = TOLERANCES["bfloat16"]
DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "Kimi K2 is a mixture of experts")
DEFAULT_TOKENS = 16

# A feed transform sees (block key, activation feed dict) and returns the dict the backend is given: the hook
# for injecting input faults (tests) without touching the golden files.
FeedTransform = Callable[[str, dict], dict]


def tolerance(dtype: str, activation_quant: int) -> tuple[float, float]:
    """(atol factor on max|ref|, rtol) for outputs of a graph computing in `dtype`."""
    atol, rtol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
    if activation_quant:
        atol, rtol = max(atol, W8A8_FLOOR[0]), max(rtol, W8A8_FLOOR[1])
    return atol, rtol


# ---- what to compare ----------------------------------------------------------------------------------------

def default_layers(cfg) -> list[tuple[str, int | None]]:
    """The embedding, the first dense block, the first, a middle and the last MoE block, the head."""
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    layers = dense[:1] + sorted({moe[0], moe[len(moe) // 2], moe[-1]} if moe else set())
    return [("embedding", None)] + [(cfg.layer_kind(i), i) for i in layers] + [("head", None)]


def parse_layers(spec: str | None, cfg) -> list[tuple[str, int | None]]:
    if not spec:
        return default_layers(cfg)
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if item in ("embedding", "head"):
            pair = (item, None)
        elif item.isdigit() and int(item) < cfg.num_hidden_layers:
            pair = (cfg.layer_kind(int(item)), int(item))
        else:
            raise K2Error(f"--layers: {item!r} is not embedding, head or a layer index 0..{cfg.num_hidden_layers - 1}")
        if pair not in out:
            out.append(pair)
    return out


def prompt_ids(model_dir: Path, texts: list[str] | None, cfg) -> list[list[int]]:
    """`texts` (default DEFAULT_PROMPTS) tokenized when the checkpoint has a tokenizer; without one, fixed
    pseudo-random ids of two different lengths (so the batch is still left-padded)."""
    from k2trt.runtime import tokenizer as T

    if (Path(model_dir) / T.RANKS_FILE).exists():
        tok = T.KimiTokenizer.from_dir(model_dir)
        texts = texts or list(DEFAULT_PROMPTS)
        ids = [tok.encode(t) for t in texts]
        for t, i in zip(texts, ids):
            if not i:
                raise K2Error(f"--prompt {t!r} encodes to no tokens")
        return ids
    if texts:
        raise K2Error(f"--prompt needs a tokenizer, and {model_dir} has none ({T.RANKS_FILE})")
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 7)]


# ---- one table ------------------------------------------------------------------------------------------------

@dataclass
class Row:
    block: str
    backend: str
    output: str
    max_abs: float | None
    max_rel: float | None  # max |diff| / max |ref|
    cosine: float | None
    tol: str
    passed: bool

    def cells(self) -> list[str]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        return [self.block, self.backend, self.output, f(self.max_abs, ".3g"), f(self.max_rel, ".3g"),
                f(self.cosine, ".7f"), self.tol, "pass" if self.passed else "FAIL"]


HEADER = ["block", "backend", "output", "max abs", "max rel", "cosine", "atol / rtol", "result"]


def format_table(rows: list[Row]) -> str:
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(c) for c in cells[1:]])


@dataclass
class Report:
    rows: list[Row]

    @property
    def failed_blocks(self) -> list[str]:
        seen = []
        for r in self.rows:
            if not r.passed and f"{r.block} ({r.backend})" not in seen:
                seen.append(f"{r.block} ({r.backend})")
        return seen

    @property
    def passed(self) -> bool:
        return not self.failed_blocks

    def summary(self) -> str:
        if self.passed:
            return f"compare: all {len(self.rows)} checks passed"
        return f"compare: FAILED: {', '.join(self.failed_blocks)}"


# ---- polygraphy comparison -------------------------------------------------------------------------------------

def _cosine(a: np.ndarray | None, b: np.ndarray) -> float:
    if a is None or a.shape != b.shape:
        return -math.inf
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na and nb else float(na == nb)


def thresholds(golden: list[dict], factor: float) -> tuple[dict[str, float], dict[str, float]]:
    """Per output: (max |ref| over the golden feeds, atol = factor * that)."""
    scale = {n: max(float(np.abs(g[n]).max()) for g in golden) for n in golden[0]}
    return scale, {n: factor * s for n, s in scale.items()}


def compare_outputs(block: str, backend: str, golden: list[dict], actual, tol: tuple[float, float],
                    labels: dict[str, str] | None = None) -> list[Row]:
    """Rows for one block: polygraphy's elementwise check of `actual` (RunResults of one runner) against the
    golden outputs (one dict per feed), with atol = tol[0] * max|ref| per output."""
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc

    from k2trt.runtime.polygraphy_support import quiet

    scale, atol = thresholds(golden, tol[0])
    results = RunResults()
    results.add(golden, runner_name="reference")
    ((runner, iters),) = actual.items()
    results[runner] = iters
    with quiet():
        # (runner, reference): polygraphy's relative error divides by the second output, the reference.
        acc = Comparator.compare_accuracy(results, comparisons=[(1, 0)],
                                          compare_func=SimpleCompareFunc(atol=atol, rtol=tol[1]))
    if not hasattr(acc, "values"):  # AccuracyResults: one AccuracyResult per compare func
        acc = acc[0]
    per_iter = next(iter(acc.values()))
    rows = []
    for n in golden[0]:
        checks = [it.get(n, False) for it in per_iter]
        # A bare False (a missing output or a shape mismatch) carries no metrics.
        max_abs = float(np.max([float(getattr(c, "max_absdiff", math.inf)) for c in checks]))  # NaN stays NaN
        cos = float(np.min([_cosine(it[n] if n in it else None, g[n]) for it, g in zip(iters, golden)]))
        rows.append(Row(block, backend, (labels or {}).get(n, n), max_abs, max_abs / scale[n] if scale[n] else None,
                        cos, f"{atol[n]:.1e} / {tol[1]:.0e}", all(bool(c) for c in checks)))
    return rows


# ---- the run ------------------------------------------------------------------------------------------------

@dataclass
class Setup:
    weights: object  # the reference's weight source (a Checkpoint, or RandomWeights)
    export_dir: Path
    prompts: list[list[int]]
    backends: tuple[str, ...] = ("ort",)
    layers: list[tuple[str, int | None]] | None = None  # default_layers()
    tokens: int = DEFAULT_TOKENS  # greedy steps of the end-to-end rows; 0 = no end-to-end rows
    save_dir: Path | None = None  # default <export_dir>/compare
    engines: Path | None = None
    providers: list[str] | None = None
    # Fault-injection hooks (tests): the weight source the backends bind (default: `weights`), and a transform of
    # the activation feeds a backend receives in the block rows (the saved golden files are never transformed).
    backend_weights: object = None
    feed_transform: FeedTransform | None = None


def make_backend(name: str, setup: Setup):
    weights = setup.backend_weights if setup.backend_weights is not None else setup.weights
    if name == "ort":
        from k2trt.runtime.ort_backend import OrtBackend

        return OrtBackend(setup.export_dir, weights, providers=setup.providers)
    if name == "trt":
        if setup.engines is None:
            raise K2Error("--backends trt needs --engines DIR (run `k2trt build` first)")
        from k2trt.runtime.trt.backend import TrtBackend
        from k2trt.runtime.trt.engine_manifest import import_tensorrt

        import_tensorrt()  # one clear line when TensorRT is missing, before any engine is read
        return TrtBackend(setup.engines, weights)
    raise K2Error(f"--backends: unknown backend {name!r} (choose from ort, trt)")


def _dtype_name(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def save_case(case, out_dir: Path) -> None:
    """inputs.json: the feeds (list of dicts); golden.json: the reference's RunResults."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    from k2trt.runtime.polygraphy_support import quiet

    out_dir.mkdir(parents=True, exist_ok=True)
    golden = RunResults()
    golden.add(case.outputs, runner_name="reference")
    with quiet():
        save_json(case.feeds, str(out_dir / "inputs.json"))
        golden.save(str(out_dir / "golden.json"))


def _ort_results(backend, case, out_dir: Path, feeds: list[dict], providers):
    """Bind the layer's prepared weights into its ORT graph (saved as model.onnx), run the feeds with OnnxrtRunner."""
    import onnx
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    from k2trt.runtime.polygraphy_support import bind_weights, ort_session, quiet

    prepared = backend.prepared_weights(case.kind, case.layer)
    # float8 travels as its bytes; bind_weights gives each array the graph input's declared element type
    arrays = {n: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy() for n, t in prepared.items()}
    model = bind_weights(onnx.load(str(backend.graph_path(case.kind))), arrays)
    del arrays, prepared
    path = out_dir / "model.onnx"
    big = sum(len(t.raw_data) for t in model.graph.initializer) > (1 << 30)  # protobuf stops at 2 GiB
    onnx.save_model(model, str(path), save_as_external_data=big, location="model.onnx.data")
    runner = OnnxrtRunner(functools.partial(ort_session, str(path), providers), name="onnxrt")
    with quiet():
        return Comparator.run([runner], data_loader=feeds)


def _backend_results(backend, case, feeds: list[dict], name: str):
    from polygraphy.comparator import Comparator

    from k2trt.runtime.polygraphy_support import BackendRunner, quiet

    with quiet():
        return Comparator.run([BackendRunner(backend, case.kind, case.layer, name=name)], data_loader=feeds)


def _command(out_dir: Path, atol: dict, rtol: float) -> str:
    tol = lambda d: " ".join(f"{n}:{v:.6g}" for n, v in d.items())  # noqa: E731
    return (f"polygraphy run {out_dir}/model.onnx --onnxrt --load-inputs {out_dir}/inputs.json "
            f"--load-outputs {out_dir}/golden.json --atol {tol(atol)} --rtol {tol({n: rtol for n in atol})}\n")


def block_rows(name: str, backend, golden, setup: Setup, tol) -> list[Row]:
    save_root = Path(setup.save_dir or Path(setup.export_dir) / "compare")
    rows = []
    for case in golden.cases.values():
        out_dir = save_root / case.key if name == "ort" else save_root / case.key / name
        save_case(case, out_dir)
        feeds = case.feeds
        if setup.feed_transform is not None:
            feeds = [setup.feed_transform(case.key, dict(f)) for f in feeds]
        if name == "ort":
            results = _ort_results(backend, case, out_dir, feeds, setup.providers)
            (out_dir / "command.txt").write_text(_command(out_dir, thresholds(case.outputs, tol[0])[1], tol[1]))
        else:
            results = _backend_results(backend, case, feeds, name)
        rows += compare_outputs(case.key, name, case.outputs, results, tol)
    return rows


def e2e_rows(name: str, backend, golden, cfg, tol) -> list[Row]:
    """First-step logits and greedy-token agreement of the chained backend against the reference's run."""
    from polygraphy.comparator import RunResults

    rec = Recorder(backend, cfg, [])
    results, _ = Generator(rec, cfg).generate(golden.prompts, len(golden.tokens[0]))
    actual = RunResults()
    actual.add([{"logits": rec.logits[0]}], runner_name=name)
    rows = compare_outputs("e2e", name, [{"logits": golden.step_logits[0]}], actual, tol,
                           labels={"logits": "first-step logits"})
    atol = thresholds([{"logits": golden.step_logits[0]}], tol[0])[1]["logits"]
    agree = total = ties = 0
    ok = True
    for seq, (want, got) in enumerate(zip(golden.tokens, (r.token_ids for r in results))):
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        agree, total = agree + n, total + len(want)
        if n < len(want):
            ref = golden.step_logits[n][seq]
            if ref[want[n]] - ref[got[n]] <= atol:
                ties += 1  # the reference itself barely prefers its token: not a backend error
            else:
                ok = False
    label = f"greedy tokens {agree}/{total}" + (f" ({ties} near-tie)" if ties else "")
    rows.append(Row("e2e", name, label, None, None, None, "identical", ok))
    return rows


def compare(setup: Setup, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
            backends: dict | None = None) -> Report:
    """Every row of the table. `backends` (name -> Backend) replaces the ones setup.backends names; a backend
    named "ort" is judged as the ORT form (W8A16), any other as the TensorRT-bound form."""
    from k2trt.export.manifest import check_matches, read_manifest
    from k2trt.runtime.torch_backend import TorchBackend

    cfg = setup.weights.config
    manifest = read_manifest(Path(setup.export_dir))
    check_matches(manifest, cfg, str(setup.export_dir))
    for key, entry in manifest["graphs"].items():
        acts = [i["name"] for i in entry["inputs"] if i["name"] not in entry["weights"]]
        if acts != list(ACTIVATIONS[entry["kind"]][0]):
            raise K2Error(f"{setup.export_dir}: graph {key} has activation inputs {acts}; re-export with this version")
    layers = setup.layers or default_layers(cfg)
    if backends is None:
        backends = {name: make_backend(name, setup) for name in setup.backends}  # fail early on a missing one
    goldens: dict[int, object] = {}
    rows: list[Row] = []
    for name, backend in backends.items():
        form = "ort" if name == "ort" else "trt"
        aq = manifest["graphs"][f"{form}/moe_block"]["activation_quant"]
        if aq not in goldens:
            log(f"compare: reference run (activation_quant={aq}) on {len(setup.prompts)} prompt(s)")
            goldens[aq] = capture(TorchBackend(setup.weights, "float32", aq), cfg, setup.prompts, layers,
                                  setup.tokens)
        tol = tolerance(_dtype_name(backend.act_dtype), aq)
        log(f"compare: {name}: {len(layers)} blocks")
        rows += block_rows(name, backend, goldens[aq], setup, tol)
        if setup.tokens:
            log(f"compare: {name}: end to end, {setup.tokens} greedy tokens")
            rows += e2e_rows(name, backend, goldens[aq], cfg, tol)
    return Report(rows)


# ---- the subcommand -------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (weights, config, tokenizer)")
    p.add_argument("--onnx", type=Path, required=True, help="export directory (k2trt export)")
    p.add_argument("--engines", type=Path, help="engine directory (k2trt build), for --backends trt")
    p.add_argument("--backends", help="comma-separated: ort, trt (default: ort, plus trt with --engines)")
    p.add_argument("--layers", help="comma-separated blocks: embedding, head, layer indices "
                                    "(default: embedding, the dense block, first/middle/last MoE block, head)")
    p.add_argument("--save-dir", type=Path, help="where the polygraphy files go (default: <onnx>/compare)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable; default: two fixed prompts)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"greedy tokens compared end to end (default {DEFAULT_TOKENS}; 0 = no end-to-end rows)")
    p.add_argument("--providers", default="CPUExecutionProvider", help="ONNX Runtime providers, comma-separated")


def run(args) -> int:
    from k2trt.checkpoint import Checkpoint

    if args.tokens < 0:
        raise K2Error(f"--tokens must be >= 0, got {args.tokens}")
    backends = tuple(b.strip() for b in (args.backends or ("ort,trt" if args.engines else "ort")).split(",") if b)
    ckpt = Checkpoint.open(args.model)
    setup = Setup(
        weights=ckpt,
        export_dir=args.onnx,
        prompts=prompt_ids(args.model, args.prompt, ckpt.config),
        backends=backends,
        layers=parse_layers(args.layers, ckpt.config),
        tokens=args.tokens,
        save_dir=args.save_dir,
        engines=args.engines,
        providers=args.providers.split(","),
    )
    report = compare(setup)
    print(format_table(report.rows))
    print(report.summary())
    return 0 if report.passed else 1
