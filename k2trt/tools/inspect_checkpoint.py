"""`k2trt inspect (DIR | --preset NAME) [--json]`: the parameter table derived from the config, and where the
bytes go.

Every count comes from the tensor table in graphs/weights.py: logical parameters (scales excluded, INT4 values
counted unpacked: packing changes storage, not the model) and the bytes each component stores (weights, scales,
INT4 shapes) in the format the checkpoint's quantization_config gives it. Given a checkpoint directory, each row
is also summed from the safetensors headers (no tensor data read but INT4 weight_shapes) and every difference is
reported, with a non-zero exit; tensors outside the text model (K2.5's vision tower) are listed, never loaded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.weights import (
    PARAM,
    TensorSpec,
    attention_specs,
    block_weight_specs,
    dense_mlp_specs,
    expert_specs,
    global_specs,
    layer_prefix,
    layer_specs,
    norm_specs,
    parameter_count,
    router_specs,
    shared_expert_specs,
    stored_bytes,
    weight_formats,
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
    bytes: int  # stored, as the weight table says
    instances: Instances = field(repr=False)
    headers_total: int | None = None
    headers_bytes: int | None = None

    def tensors(self):
        for prefix, specs in self.instances:
            for s in specs:
                yield prefix + s.name, s


def _row(section: str, component: str, instances: Instances) -> Row:
    counted: dict[int, tuple[int, int]] = {}  # id(specs) -> (parameters, bytes): one list serves many layers
    for _, specs in instances:
        if id(specs) not in counted:
            counted[id(specs)] = (parameter_count(specs), stored_bytes(specs))
    each = [counted[id(specs)] for _, specs in instances]
    per = {params for params, _ in each}
    return Row(section, component, per.pop() if len(per) == 1 else None, len(instances),
               sum(params for params, _ in each), sum(size for _, size in each), instances)


def _pick(specs: list[TensorSpec], *parts: str) -> list[TensorSpec]:
    return [s for s in specs if any(f".{p}." in f".{s.name}" for p in parts)]


def parameter_rows(cfg: K2Config) -> list[Row]:
    weight_formats(cfg)  # refuses a quantization_config k2trt cannot run, naming the field
    layers = range(cfg.num_hidden_layers)
    dense = [i for i in layers if not cfg.is_moe_layer(i)]
    moe = [i for i in layers if cfg.is_moe_layer(i)]
    rows: list[Row] = []

    def per_layer(section: str, component: str, specs_of, which) -> None:
        rows.append(_row(section, component, [(layer_prefix(i), specs_of(cfg.layer_kind(i))) for i in which]))

    for part in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj"):
        per_layer("attention", part, lambda kind, part=part: _pick(attention_specs(cfg, kind), part), layers)
    per_layer("attention", "attention", lambda kind: attention_specs(cfg, kind), layers)
    per_layer("block norms", "input + post-attention norms", lambda kind: norm_specs(cfg), layers)

    if dense:
        mlp = dense_mlp_specs(cfg)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            per_layer("dense MLP", proj, lambda kind, proj=proj: _pick(mlp, proj), dense)
        per_layer("dense MLP", "dense MLP", lambda kind: mlp, dense)

    if moe:
        experts = [expert_specs(cfg, e) for e in range(cfg.n_routed_experts)]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            picked = [_pick(e, proj) for e in experts]
            rows.append(_row("MoE", f"routed expert {proj}", [(layer_prefix(i), p) for i in moe for p in picked]))
        rows.append(_row("MoE", "one routed expert", [(layer_prefix(i), e) for i in moe for e in experts]))
        all_experts = [s for e in experts for s in e]
        per_layer("MoE", f"{cfg.n_routed_experts} routed experts", lambda kind: all_experts, moe)
        per_layer("MoE", "shared expert", lambda kind: shared_expert_specs(cfg), moe)
        router_w, router_b = router_specs(cfg)
        per_layer("MoE", "router weight", lambda kind: [router_w], moe)
        per_layer("MoE", "router bias", lambda kind: [router_b], moe)

    # layer_specs depends only on the block kind, so it is built once per kind
    suffixes = {kind: layer_specs(cfg, which[0]) for kind, which in (("dense_block", dense), ("moe_block", moe))
                if which}
    for component, kind, which in (("dense block", "dense_block", dense), ("MoE block", "moe_block", moe)):
        if which:
            row = _row("blocks", component, [(layer_prefix(i), suffixes[kind]) for i in which])
            row.per_instance = parameter_count(block_weight_specs(cfg, kind))  # the block graph's inputs agree
            rows.append(row)
    all_blocks = [(layer_prefix(i), suffixes[cfg.layer_kind(i)]) for i in layers]
    rows.append(_row("blocks", f"all {cfg.num_hidden_layers} blocks", all_blocks))
    rows[-1].per_instance = None

    embed, norm, head = global_specs(cfg)
    for component, spec in (("embeddings", embed), ("final norm", norm), ("lm_head", head)):
        rows.append(_row("model", component, [("", [spec])]))
    everything = all_blocks + [("", [embed, norm, head])]
    rows.append(_row("model", "model total", everything))
    rows[-1].per_instance, rows[-1].count = None, 1
    return rows


def cross_check(rows: list[Row], ckpt) -> list[str]:
    """Fill each row's headers_total and headers_bytes; return every difference (rows, then tensor-level
    problems). Parameters are counted from the headers as the weight table counts them (INT4 words unpacked)."""
    headers = ckpt.header_specs()
    counted: dict[str, tuple[int, int]] = {}  # name -> (bytes, parameters): a tensor is in several rows (K2: 4)
    diffs: list[str] = []
    for row in rows:
        row.headers_total = row.headers_bytes = 0
        for name, spec in row.tensors():
            c = counted.get(name)
            if c is None:
                h = headers.get(name)
                if h is None:
                    continue
                c = counted[name] = (h.nbytes, _numel(h.shape) * spec.pack if spec.kind == PARAM else 0)
            row.headers_bytes += c[0]
            row.headers_total += c[1]
        if row.headers_total != row.total:
            diffs.append(f"{row.section} / {row.component}: config {row.total:,}, headers {row.headers_total:,}")
    return diffs + ckpt.problems()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- output --------------------------------------------------------------------------------------

def formats_line(cfg: K2Config) -> str:
    """How the checkpoint stores each kind of linear, e.g. "routed experts int4 (group 32); attention bf16; ..."."""
    f = weight_formats(cfg)
    parts = []
    for label, kind, role in (("routed experts", "moe_block", "mlp.experts.gate_proj"),
                              ("shared expert", "moe_block", "mlp.shared_experts.gate_proj"),
                              ("attention", "moe_block", "self_attn.q_a_proj"),
                              ("dense MLP", "dense_block", "mlp.gate_proj")):
        if (cfg.num_moe_layers if kind == "moe_block" else cfg.num_hidden_layers - cfg.num_moe_layers):
            parts.append(f"{label} {f[(kind, role)].describe()}")
    return "; ".join(parts + ["norms, router, embeddings, lm_head bf16"])


def byte_unit(rows: list[Row]) -> tuple[str, float]:
    """GB for a real model, MB for the embedded tiny ones."""
    return ("GB", 1e9) if rows[-1].bytes >= 1e10 else ("MB", 1e6)


def size(n: int | None, unit: tuple[str, float]) -> str:
    return "" if n is None else f"{n / unit[1]:,.3f}"


def other_groups(others: dict) -> dict[str, tuple[int, int]]:
    """Tensors outside the text model grouped by their first name part: -> (count, bytes)."""
    out: dict[str, tuple[int, int]] = {}
    for name, h in others.items():
        key = name.split(".", 1)[0]
        count, size = out.get(key, (0, 0))
        out[key] = (count + 1, size + h.nbytes)
    return out


def render_text(source: str, cfg: K2Config, rows: list[Row], diffs: list[str] | None,
                others: dict | None = None) -> str:
    n_moe = cfg.num_moe_layers
    lines = [
        f"{source}: {cfg.num_hidden_layers} blocks ({cfg.num_hidden_layers - n_moe} dense, {n_moe} MoE), "
        f"{cfg.n_routed_experts} routed experts (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, "
        f"hidden {cfg.hidden_size:,}, vocab {cfg.vocab_size:,}" + (f", layout {cfg.layout}" if cfg.layout != "k2" else ""),
        f"stored as: {formats_line(cfg)}",
        "parameters (scales excluded; INT4 values counted unpacked) and stored bytes (weights, scales, shapes)",
        "",
    ]
    checked = diffs is not None
    unit = byte_unit(rows)
    head = f"{'component':<34}{'per instance':>18}{'count':>9}{'total':>24}{'stored ' + unit[0]:>14}"
    lines.append(head + (f"{'headers':>24}{'headers ' + unit[0]:>14}" if checked else ""))
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines.append(section)
        per = "" if row.per_instance is None else f"{row.per_instance:,}"
        line = f"  {row.component:<32}{per:>18}{row.count:>9,}{row.total:>24,}{size(row.bytes, unit):>14}"
        if checked:
            line += f"{'ok' if row.headers_total == row.total else f'{row.headers_total:,}':>24}"
            line += f"{size(row.headers_bytes, unit):>14}"
        lines.append(line)
    if others:
        lines += ["", "outside the text model (listed, never loaded)"]
        for key, (count, nbytes) in sorted(other_groups(others).items()):
            lines.append(f"  {key + '.*':<32}{'':>18}{count:>9,}{'':>24}{size(nbytes, unit):>14}")
    if checked:
        lines.append("")
        if diffs:
            lines.append(f"cross-check against the safetensors headers: {len(diffs)} difference(s)")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append("cross-check against the safetensors headers: every count matches")
    return "\n".join(lines)


def render_json(source: str, cfg: K2Config, rows: list[Row], diffs: list[str] | None,
                others: dict | None = None) -> str:
    out = {
        "source": source,
        "config_fingerprint": cfg.fingerprint(),
        "layout": cfg.layout,
        "formats": formats_line(cfg),
        "scales_excluded": True,
        "rows": [
            {"section": r.section, "component": r.component, "per_instance": r.per_instance, "count": r.count,
             "total": r.total, "bytes": r.bytes,
             **({} if diffs is None else {"headers_total": r.headers_total, "headers_bytes": r.headers_bytes})}
            for r in rows
        ],
        "total": rows[-1].total,
        "bytes": rows[-1].bytes,
        "outside_text_model": {k: {"tensors": c, "bytes": b} for k, (c, b) in other_groups(others or {}).items()},
        "cross_check": None if diffs is None else {"ok": not diffs, "differences": diffs},
    }
    return json.dumps(out, indent=2)


# ---- CLI -----------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    if (args.dir is None) == (args.preset is None):
        raise K2Error("give either a checkpoint DIR or --preset NAME")
    diffs, others = None, None
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
        others = ckpt.other_tensors()
    print((render_json if args.json else render_text)(source, cfg, rows, diffs, others))
    return 1 if diffs else 0
