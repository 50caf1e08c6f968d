"""`k2trt inspect (DIR | --preset NAME) [--json]`: the parameter table derived from the config.

Every count comes from the tensor table in graphs/weights.py (FP8 block scales excluded). Given a checkpoint
directory, each row is also summed from the safetensors headers (no tensor data read) and every difference
is reported, with a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.weights import (
    TensorSpec,
    attention_specs,
    block_weight_specs,
    expert_specs,
    global_specs,
    layer_prefix,
    layer_specs,
    norm_specs,
    parameter_count,
    router_specs,
    shared_expert_specs,
    swiglu_specs,
)

# Where a row's tensors are: (name prefix, suffix specs) per instance.
Instances = list[tuple[str, list[TensorSpec]]]


@dataclass
class Row:
    section: str
    component: str
    per_instance: int | None  # None where instances differ (the all-blocks row)
    count: int
    total: int
    instances: Instances = field(repr=False)
    headers_total: int | None = None

    def names(self):
        for prefix, specs in self.instances:
            for s in specs:
                if not s.is_scale:
                    yield prefix + s.name


def _row(section: str, component: str, template: list[TensorSpec], instances: Instances) -> Row:
    per = parameter_count(template)
    return Row(section, component, per, len(instances), per * len(instances), instances)


def _pick(specs: list[TensorSpec], *parts: str) -> list[TensorSpec]:
    return [s for s in specs if any(f".{p}." in f".{s.name}" for p in parts)]


def parameter_rows(cfg: K2Config) -> list[Row]:
    layers = range(cfg.num_hidden_layers)
    dense = [i for i in layers if not cfg.is_moe_layer(i)]
    moe = [i for i in layers if cfg.is_moe_layer(i)]
    rows: list[Row] = []

    def per_layer(section: str, component: str, specs: list[TensorSpec], which) -> None:
        rows.append(_row(section, component, specs, [(layer_prefix(i), specs) for i in which]))

    attn = attention_specs(cfg)
    for part in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj"):
        per_layer("attention", part, _pick(attn, part), layers)
    per_layer("attention", "attention", attn, layers)
    per_layer("block norms", "input + post-attention norms", norm_specs(cfg), layers)

    mlp = swiglu_specs("mlp", cfg.hidden_size, cfg.intermediate_size)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        per_layer("dense MLP", proj, _pick(mlp, proj), dense)
    per_layer("dense MLP", "dense MLP", mlp, dense)

    experts = [expert_specs(cfg, e) for e in range(cfg.n_routed_experts)]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        picked = [_pick(e, proj) for e in experts]
        rows.append(_row("MoE", f"routed expert {proj}", picked[0],
                         [(layer_prefix(i), p) for i in moe for p in picked]))
    rows.append(_row("MoE", "one routed expert", experts[0], [(layer_prefix(i), e) for i in moe for e in experts]))
    all_experts = [s for e in experts for s in e]
    per_layer("MoE", f"{cfg.n_routed_experts} routed experts", all_experts, moe)
    per_layer("MoE", "shared expert", shared_expert_specs(cfg), moe)
    router_w, router_b = router_specs(cfg)
    per_layer("MoE", "router weight", [router_w], moe)
    per_layer("MoE", "router bias", [router_b], moe)

    # Per-instance counts from the block graphs' inputs; the header check uses the checkpoint's names
    # (layer_specs depends only on the block kind, so it is built once per kind).
    suffixes = {kind: layer_specs(cfg, which[0]) for kind, which in (("dense_block", dense), ("moe_block", moe))
                if which}
    for component, kind, which in (("dense block", "dense_block", dense), ("MoE block", "moe_block", moe)):
        rows.append(_row("blocks", component, block_weight_specs(cfg, kind),
                         [(layer_prefix(i), suffixes[kind]) for i in which]))
    all_blocks = [(layer_prefix(i), suffixes[cfg.layer_kind(i)]) for i in layers]
    rows.append(Row("blocks", f"all {cfg.num_hidden_layers} blocks", None, len(all_blocks),
                    sum(parameter_count(s) for _, s in all_blocks), all_blocks))

    embed, norm, head = global_specs(cfg)
    for component, spec in (("embeddings", embed), ("final norm", norm), ("lm_head", head)):
        rows.append(_row("model", component, [spec], [("", [spec])]))
    everything = all_blocks + [("", [embed, norm, head])]
    rows.append(Row("model", "model total", None, 1, sum(parameter_count(s) for _, s in everything), everything))
    return rows


def cross_check(rows: list[Row], ckpt) -> list[str]:
    """Fill each row's headers_total; return every difference (rows, then tensor-level problems)."""
    headers = ckpt.header_specs()
    numel = {name: _numel(h.shape) for name, h in headers.items()}
    diffs: list[str] = []
    for row in rows:
        row.headers_total = sum(numel.get(n, 0) for n in row.names())
        if row.headers_total != row.total:
            diffs.append(f"{row.section} / {row.component}: config {row.total:,}, headers {row.headers_total:,}")
    in_headers = sum(n for name, n in numel.items() if not name.endswith("weight_scale_inv"))
    model_total = rows[-1].total
    if in_headers != model_total:
        diffs.append(f"all tensors in the headers (scales excluded): {in_headers:,}, config {model_total:,}")
    return diffs + ckpt.problems()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- output --------------------------------------------------------------------------------------

def render_text(source: str, cfg: K2Config, rows: list[Row], diffs: list[str] | None) -> str:
    n_moe = cfg.num_moe_layers
    lines = [
        f"{source}: {cfg.num_hidden_layers} blocks ({cfg.num_hidden_layers - n_moe} dense, {n_moe} MoE), "
        f"{cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, "
        f"hidden {cfg.hidden_size:,}, vocab {cfg.vocab_size:,}",
        "parameters (FP8 block scales excluded)",
        "",
    ]
    checked = diffs is not None
    head = f"{'component':<34}{'per instance':>18}{'count':>9}{'total':>24}"
    lines.append(head + (f"{'headers':>24}" if checked else ""))
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines.append(section)
        per = "" if row.per_instance is None else f"{row.per_instance:,}"
        line = f"  {row.component:<32}{per:>18}{row.count:>9,}{row.total:>24,}"
        if checked:
            line += f"{'ok' if row.headers_total == row.total else f'{row.headers_total:,}':>24}"
        lines.append(line)
    if checked:
        lines.append("")
        if diffs:
            lines.append(f"cross-check against the safetensors headers: {len(diffs)} difference(s)")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append("cross-check against the safetensors headers: every count matches")
    return "\n".join(lines)


def render_json(source: str, cfg: K2Config, rows: list[Row], diffs: list[str] | None) -> str:
    out = {
        "source": source,
        "config_fingerprint": cfg.fingerprint(),
        "scales_excluded": True,
        "rows": [
            {"section": r.section, "component": r.component, "per_instance": r.per_instance, "count": r.count,
             "total": r.total, **({} if diffs is None else {"headers_total": r.headers_total})}
            for r in rows
        ],
        "total": rows[-1].total,
        "cross_check": None if diffs is None else {"ok": not diffs, "differences": diffs},
    }
    return json.dumps(out, indent=2)


# ---- CLI -----------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", nargs="?", type=Path, help="a checkpoint directory")
    parser.add_argument("--preset", metavar="NAME", help="a built-in config instead (kimi-k2, tiny)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    if (args.dir is None) == (args.preset is None):
        raise K2Error("give either a checkpoint DIR or --preset NAME")
    diffs = None
    if args.preset is not None:
        cfg = K2Config.preset(args.preset)
        source = f"{args.preset} (preset)"
        rows = parameter_rows(cfg)
    else:
        from k2trt.checkpoint import Checkpoint

        ckpt = Checkpoint.open(args.dir)
        cfg = ckpt.config
        source = str(args.dir)
        rows = parameter_rows(cfg)
        diffs = cross_check(rows, ckpt)
    print((render_json if args.json else render_text)(source, cfg, rows, diffs))
    return 1 if diffs else 0
