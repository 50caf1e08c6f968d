"""`k2trt plan (--model DIR | --preset kimi-k2) --device-memory SIZE (--devices N [--layout pp|auto|compare] |
[--pipeline P] [--expert-parallel E]) [--reserve SIZE] [--max-context N --max-batch B] [--stages 8,8,…] [--json]`:
how the model splits over devices — pipeline stages, expert-parallel ranks, or both — and what a decode step of
that layout costs by the roofline (runtime/distributed/roofline.py).

Sizes are exact bytes: weights and scales from the checkpoint's safetensors headers (or the weight table for a
preset) plus each block's latent cache at the requested context and batch, plus a reserve per device. `--layout
compare` prints every layout of N devices side by side; `--layout auto` picks the fitting one with the shortest
decode step. A layout that does not fit is refused (exit 2) naming the smallest one that would.
"""

from __future__ import annotations

import json
import math

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.distributed import layout as L
from k2trt.runtime.distributed import placement, roofline

MAX_DEVICES = 1 << 16


def sized_items(args, cfg: K2Config) -> list[placement.Item]:
    """Every block's bytes, its cache for the whole batch (a layout divides it among its ranks)."""
    cache = placement.cache_bytes_per_layer(cfg, args.max_context, args.max_batch)
    if args.model is None:
        return placement.items_from_config(cfg, cache)
    from k2trt.checkpoint import Checkpoint

    ckpt = Checkpoint.open(args.model)
    return placement.items_from_headers(cfg, ckpt.header_specs(), cache)


def links_from(args) -> roofline.Links:
    bw = {name: placement.parse_size(getattr(args, name.replace("-", "_")), f"--{name}")
          for name in ("hbm-bandwidth", "link-bandwidth", "network-bandwidth")}
    bad = [n for n, v in bw.items() if v <= 0]
    if bad:
        raise K2Error(f"--{bad[0]} must be more than 0 bytes per second")
    for name in ("all_to_all_latency", "hop_latency"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise K2Error(f"--{name.replace('_', '-')} must be a finite number of microseconds >= 0, got {v}")
    a2a = None if args.all_to_all_latency is None else args.all_to_all_latency * 1e-6
    return roofline.Links(bw["hbm-bandwidth"], bw["link-bandwidth"], bw["network-bandwidth"], args.node_size, a2a,
                          args.hop_latency * 1e-6)


def chosen_layout(args, cfg: K2Config) -> L.Layout | None:
    """The one layout asked for; None for --layout auto/compare."""
    explicit = args.pipeline is not None or args.expert_parallel is not None
    if explicit and args.layout is not None:
        raise K2Error("give --layout with --devices, or --pipeline/--expert-parallel, not both")
    if explicit:
        lay = L.Layout(args.pipeline or 1, args.expert_parallel or 1)
        if args.devices is not None and args.devices != lay.devices:
            raise K2Error(f"--devices {args.devices} is not --pipeline {lay.pipeline} x --expert-parallel "
                          f"{lay.expert_parallel} = {lay.devices}")
        return lay
    if args.devices is None:
        raise K2Error("give --devices N, or --pipeline P and/or --expert-parallel E")
    if args.layout in (None, "pp"):
        return L.Layout(args.devices, 1)
    if args.stages:
        raise K2Error("--stages splits one layout's stages: give it with --pipeline, not --layout "
                      f"{args.layout}")
    return None


# ---- output -----------------------------------------------------------------------------------------------------

def _table(rows: list[tuple], right_from: int) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r):  # names left, numbers right
        return "  ".join(c.rjust(w) if i >= right_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]]


def _gb(n: int) -> str:
    return placement.format_gb(n)


def _ranks(stage: placement.Stage, e: int) -> str:
    a = stage.index * e
    return str(a) if e == 1 else f"{a}–{a + e - 1}"


def estimate_line(est: roofline.StepEstimate) -> str:
    return (f"decode step at batch {est.batch} (roofline): {est.step_s * 1e3:.2f} ms, {est.tokens_per_s:,.0f} tok/s; "
            f"busiest rank reads {_gb(est.read_bytes)} GB and sends {est.link_bytes / 1e6:.1f} MB; all-to-all "
            f"{100 * est.all_to_all_share:.0f}% of the step")


def render(plan: L.LayoutPlan, est: roofline.StepEstimate, source: str) -> str:
    pl, e = plan.placement, plan.layout.expert_parallel
    rows = [("stage", "ranks", "layers", "weight GB", "of it experts", "cache GB", "free GB")]
    rows += [(str(s.index), _ranks(s, e), s.describe(), _gb(s.weight_bytes), _gb(sum(i.expert_bytes for i in s.items)),
              _gb(s.cache_bytes), _gb(s.free)) for s in pl.stages]
    head = (f"{source}: {plan.layout.name} on {plan.layout.devices} devices, {_gb(pl.device_memory)} GB per device, "
            f"{_gb(pl.reserve)} GB reserved; heaviest rank {_gb(pl.heaviest.bytes)} GB "
            f"(sizes per rank: every rank of a stage holds the same)")
    return "\n".join([head, ""] + _table(rows, 3) + ["", estimate_line(est)])


def render_compare(plans: list[tuple[L.LayoutPlan, roofline.StepEstimate]], source: str, devices: int,
                   memory: int, batch: int, context: int) -> str:
    rows = [("layout", "fits", "heaviest rank GB", "weights GB/rank", "cache GB/rank", "read GB/step",
             "sent MB/step", "all-to-all", "ms/step", "tok/s")]
    for plan, est in plans:
        h = plan.heaviest
        rows.append((plan.layout.name, "yes" if plan.fits else "no", _gb(h.bytes), _gb(h.weight_bytes),
                     _gb(h.cache_bytes), _gb(est.read_bytes), f"{est.link_bytes / 1e6:.1f}",
                     f"{100 * est.all_to_all_share:.0f}%", f"{est.step_s * 1e3:.2f}", f"{est.tokens_per_s:,.0f}"))
    head = (f"{source}: layouts of {devices} devices of {_gb(memory)} GB, batch {batch} at context {context} "
            f"(per rank: the busiest; decode step by the roofline)")
    return "\n".join([head, ""] + _table(rows, 1))


def plan_json(plan: L.LayoutPlan, est: roofline.StepEstimate) -> dict:
    pl, e = plan.placement, plan.layout.expert_parallel
    return {"layout": plan.layout.name, "pipeline": plan.layout.pipeline, "expert_parallel": e,
            "devices": plan.layout.devices, "device_memory": pl.device_memory, "reserve": pl.reserve,
            "fits": plan.fits,
            "stages": [{"stage": s.index, "ranks": list(range(s.index * e, s.index * e + e)), "layers": s.layers,
                        "embedding": s.first, "head": s.last, "weight_bytes": s.weight_bytes,
                        "expert_bytes": sum(i.expert_bytes for i in s.items), "cache_bytes": s.cache_bytes,
                        "free_bytes": s.free} for s in pl.stages],
            "decode_step": {"batch": est.batch, "seconds": est.step_s, "tokens_per_s": est.tokens_per_s,
                            "read_bytes_per_rank": est.read_bytes, "sent_bytes_per_rank": est.link_bytes,
                            "all_to_all_share": est.all_to_all_share}}


# ---- the command ------------------------------------------------------------------------------------------------

def run(args) -> int:
    cfg = K2Config.from_json(args.model) if args.model is not None else K2Config.preset(args.preset)
    memory = placement.parse_size(args.device_memory, "--device-memory")
    reserve = placement.parse_size(args.reserve, "--reserve")
    if reserve >= memory:
        raise K2Error(f"--reserve {args.reserve} leaves nothing of --device-memory {args.device_memory}")
    links = links_from(args)
    lay = chosen_layout(args, cfg)
    items = sized_items(args, cfg)
    source = str(args.model) if args.model is not None else f"{args.preset} (preset)"

    def planned(layout: L.Layout, counts=None):
        plan = L.plan_layout(cfg, items, layout, memory, reserve, args.max_context, args.max_batch, counts)
        return plan, roofline.decode_step(cfg, plan, args.max_batch, links)

    if lay is not None:
        counts = placement.parse_counts(args.stages) if args.stages else None
        plan, est = planned(lay, counts)
        print(json.dumps({"source": source, **plan_json(plan, est)}) if args.json else render(plan, est, source))
        if not plan.fits:
            raise K2Error(refusal(cfg, items, plan, memory, reserve, args, counts is not None))
        return 0
    options = [planned(x) for x in L.layouts_for(cfg, args.devices)]
    fitting = [(p, e) for p, e in options if p.fits]
    best = min(fitting, key=lambda pe: pe[1].step_s) if fitting else None
    if args.layout == "compare":
        print(json.dumps({"source": source, "layouts": [plan_json(p, e) for p, e in options],
                          "best": best[0].layout.name if best else None}) if args.json else
              render_compare(options, source, args.devices, memory, args.max_batch, args.max_context)
              + ("" if best is None else f"\n\nshortest decode step that fits: {best[0].layout.name}"))
    elif best is not None:  # auto
        plan, est = best
        print(json.dumps({"source": source, **plan_json(plan, est)}) if args.json else
              render(plan, est, source) + f"\n(chosen by --layout auto among {len(options)} layouts of "
                                          f"{args.devices} devices)")
    if best is None:
        raise K2Error(f"no layout of {args.devices} devices fits; {smallest_any(cfg, items, memory, reserve, args)}")
    return 0


def refusal(cfg, items, plan: L.LayoutPlan, memory: int, reserve: int, args, explicit_counts: bool) -> str:
    over = [s for s in plan.placement.stages if s.free < 0]
    e = plan.layout.expert_parallel
    start = 1 if explicit_counts else plan.layout.pipeline + 1
    need = L.smallest_pipeline(cfg, items, e, memory, reserve, args.max_context, args.max_batch, start)
    if need is None:
        fix = "no stage count fits: one block alone exceeds the device"
    elif e == 1:
        fix = f"the smallest device count that fits is {need}"
    else:
        fix = f"the smallest that fits with --expert-parallel {e} is --pipeline {need} ({need * e} devices)"
    return (f"stage {over[0].index} needs {_gb(over[0].bytes)} GB per rank, more than the "
            f"{_gb(over[0].capacity)} GB a device has after the reserve; {fix}")


def smallest_any(cfg, items, memory: int, reserve: int, args) -> str:
    """The fewest devices, above those asked for, with a layout that fits."""
    for n in range(args.devices + 1, MAX_DEVICES):
        for lay in L.layouts_for(cfg, n):
            if L.plan_layout(cfg, items, lay, memory, reserve, args.max_context, args.max_batch).fits:
                return f"the smallest device count with a layout that fits is {n} ({lay.name})"
        if n > cfg.num_hidden_layers * cfg.n_routed_experts:
            break
    return "no device count fits"
