"""The export API: the per-block ONNX graphs of a config (TensorRT-bound and ONNX Runtime forms) and their
manifest, written under one directory. Graphs hold no weights, so real K2 exports in seconds on a CPU."""

from __future__ import annotations

import time
from pathlib import Path

from k2trt.config import K2Config
from k2trt.dirlock import writing
from k2trt.errors import K2Error
from k2trt.export import manifest_writer as M
from k2trt.config import BLOCK_KINDS, MOE_PART_KINDS, check_expert_parallel, expert_range
from k2trt.export.block_graphs import activation_io, build_block_graph, paged_io
from k2trt.export.checks import check_onnx, check_trt_operators
from k2trt.export.draft_graphs import DRAFT_KINDS, build_draft_graph, draft_io, draft_trt_graphs
from k2trt.export.lower_ort import lower_for_ort
from k2trt.export.onnx_ops import weight_prep
from k2trt.export.trt_form import attends, engine_name, engine_names, forms, tensorrt_graph
from k2trt.graphs.fp8 import PER_TOKEN_GROUP, WEIGHT_DEQUANT


def export_kind(cfg: K2Config, out: Path, kind: str, act_dtype: str, activation_quant: int,
                expert_ranges: int = 1, expert_parallel: int = 1) -> dict[str, dict]:
    """Both forms of one block kind (or MoE part), checked and written; -> {manifest key: graph entry}."""
    first, stop = expert_range(cfg, expert_parallel, 0)
    entries = {}
    # TensorRT: one plugin per kernel (export/trt_form.py), the pool read in place, a graph per attention form
    trt_acts = {name for name, _, _ in (paged_io if attends(kind) else activation_io)(cfg, kind, act_dtype)[0]}
    for form in forms(kind):
        key = f"trt/{engine_name(kind, form)}"
        trt_model = tensorrt_graph(cfg, kind, act_dtype, activation_quant, stop - first, expert_ranges, form)
        check_onnx(trt_model, key)
        check_trt_operators(trt_model, key)
        entries[key] = M.write_graph(out, key, kind, "tensorrt", trt_model, weight_prep(trt_model), activation_quant,
                                     trt_acts)
    # ONNX Runtime's form branches on the step's shape (attention decompressed for a prefill chunk)
    ort_model = lower_for_ort(build_block_graph(cfg, kind, act_dtype, activation_quant, stop - first, branches=True),
                              act_dtype)
    check_onnx(ort_model, f"ort/{kind}")
    acts = {name for name, _, _ in activation_io(cfg, kind, act_dtype)[0]}
    # The lowering computes with dequantized weights: the W8A16 convention.
    entries[f"ort/{kind}"] = M.write_graph(out, f"ort/{kind}", kind, "onnxruntime", ort_model, weight_prep(ort_model),
                                           WEIGHT_DEQUANT, acts)
    if kind == "moe_experts":  # its R rows: what a rank may receive (runtime/tensorrt/profiles.py sizes them)
        for entry in entries.values():
            entry["dispatch"] = {"top_k": cfg.num_experts_per_tok, "ranks": expert_parallel}
    return entries


def draft_graph_keys(draft_cfg) -> list[str]:
    """The manifest keys of a draft's graphs: each TensorRT form (export/draft_graphs.py), then ONNX Runtime's."""
    return [f"trt/{name}" for _, _, name in draft_trt_graphs(draft_cfg)] + [f"ort/{kind}" for kind in DRAFT_KINDS]


def export_draft(draft, cfg: K2Config, out: Path, act_dtype: str) -> dict[str, dict]:
    """An EAGLE-3 draft's graphs, both forms, checked and written; -> {manifest key: graph entry}. They compute
    with the draft's bf16 weights as given (no FP8): the W8A16 convention's mode number."""
    entries = {}
    acts = {kind: {name for name, _, _ in draft_io(draft.config, cfg, kind, act_dtype)[0]} for kind in DRAFT_KINDS}
    for kind, form, name in draft_trt_graphs(draft.config):
        key = f"trt/{name}"
        model = build_draft_graph(draft, cfg, kind, act_dtype, branches=False, large=form == "prefill")
        check_onnx(model, key)
        check_trt_operators(model, key)
        entries[key] = M.write_graph(out, key, kind, "tensorrt", model, weight_prep(model), WEIGHT_DEQUANT,
                                     acts[kind])
    for kind in DRAFT_KINDS:
        model = lower_for_ort(build_draft_graph(draft, cfg, kind, act_dtype, branches=True), act_dtype)
        check_onnx(model, f"ort/{kind}")
        entries[f"ort/{kind}"] = M.write_graph(out, f"ort/{kind}", kind, "onnxruntime", model, weight_prep(model),
                                               WEIGHT_DEQUANT, acts[kind])
    return entries


def export(cfg: K2Config, out: Path, act_dtype: str = "float32", activation_quant: int = PER_TOKEN_GROUP,
           force: bool = False, log=print, expert_ranges: int = 1, expert_parallel: int = 1,
           draft=None) -> dict:
    """Write trt/<kind>.onnx, ort/<kind>.onnx and manifest.json under `out`; returns the manifest. Kinds whose
    graphs are up to date (same config, dtype, mode, expert ranges, expert parallelism and exporter code) are kept.
    The TensorRT form of a kind with attention reads the layer's pool in place and comes as two graphs,
    trt/<kind> (decode: attention absorbed) and trt/<kind>.prefill (attention decompressed): export/trt_form.py.
    expert_ranges > 1: the TensorRT form's routed experts in that many ranges of weight inputs
    (export/split_moe.py). expert_parallel E > 1: also the MoE block's parts for E expert-parallel ranks
    (config.MOE_PART_KINDS), the experts graph holding 1/E of the routed experts. draft: a loaded EAGLE-3 draft
    (k2trt/draft.py) whose graphs join the target's (export/draft_graphs.py; the manifest's "draft" names it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise K2Error(f"--out {out} exists and is not a directory")
    with writing(out, "k2trt export"):  # one export at a time into a directory; a killed one's temporaries go
        return _export(cfg, out, act_dtype, activation_quant, force, log, expert_ranges, expert_parallel, draft)


def _export(cfg: K2Config, out: Path, act_dtype: str, activation_quant: int, force: bool, log,
            expert_ranges: int = 1, expert_parallel: int = 1, draft=None) -> dict:
    if not 1 <= expert_ranges <= cfg.n_routed_experts:
        raise K2Error(f"--expert-ranges must be 1..{cfg.n_routed_experts}, got {expert_ranges}")
    check_expert_parallel(cfg, expert_parallel)
    previous = M.load_if_current(out, cfg, act_dtype, activation_quant, expert_ranges, expert_parallel)
    graphs: dict[str, dict] = {}
    t_all = time.perf_counter()
    kinds = BLOCK_KINDS + (MOE_PART_KINDS if expert_parallel > 1 else ())
    for i, kind in enumerate(kinds, 1):
        keys = (*(f"trt/{name}" for name in engine_names((kind,))), f"ort/{kind}")
        if not force and previous and all(M.entry_is_current(out, previous["graphs"].get(k)) for k in keys):
            graphs.update({k: previous["graphs"][k] for k in keys})
            log(f"[{i}/{len(kinds)}] {kind}: up to date")
            continue
        t0 = time.perf_counter()
        written = export_kind(cfg, out, kind, act_dtype, activation_quant, expert_ranges, expert_parallel)
        graphs.update(written)
        trt_entry = written[keys[0]]
        log(f"[{i}/{len(kinds)}] {kind}: {trt_entry['nodes']} nodes, {len(trt_entry['weights'])} weight inputs "
            f"({time.perf_counter() - t0:.1f}s)")
    draft_entry = None
    if draft is not None:
        draft_entry = {"fingerprint": draft.config.fingerprint(), "layout": draft.config.layout,
                       "aux_layer_ids": list(draft.config.aux_layer_ids)}
        keys = draft_graph_keys(draft.config)
        if (not force and previous and previous.get("draft") == draft_entry
                and all(M.entry_is_current(out, previous["graphs"].get(k)) for k in keys)):
            graphs.update({k: previous["graphs"][k] for k in keys})
            log(f"draft ({draft.config.layout} layout): up to date")
        else:
            t0 = time.perf_counter()
            graphs.update(export_draft(draft, cfg, out, act_dtype))
            log(f"draft ({draft.config.layout} layout): {len(keys)} graphs ({time.perf_counter() - t0:.1f}s)")
    manifest = M.make_manifest(cfg, act_dtype, activation_quant, graphs, expert_ranges, expert_parallel,
                               draft_entry)
    M.write_manifest(out, manifest)
    parts = f" and the MoE block's parts for {expert_parallel} expert-parallel ranks" if expert_parallel > 1 else ""
    log(f"exported {len(BLOCK_KINDS)} block kinds{parts} to {out} in {time.perf_counter() - t_all:.1f}s")
    return manifest
