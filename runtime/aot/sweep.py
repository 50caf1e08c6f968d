"""`python -m k2trt.runtime.aot.sweep`: compile every distinct AOT configuration the plugins can ask for, for a GPU
architecture, on a CPU (Triton's compiler and its bundled ptxas; no GPU, no TensorRT).

The launches are those of the plugin nodes in the TensorRT-bound graphs (every node kind, every activation dtype,
both FP8 modes, the tiny and K2 configs with FP8 and with INT4 experts — K2 also in expert ranges, each also split
for expert parallelism —, every tactic) and of `k2trt doctor`'s one-node cases, each made by the plugins' own table
(runtime/aot/nodes.py). Launches that compile to the same code (aot.config_key) are compiled once, on as many
processes as cores. For each: the configuration compile_launch settles on (it shrinks until the shared memory fits
aot.AOT_SHARED_LIMIT), its shared memory, and ptxas' registers and spills, which must fit the register file with
no spill. Each result is kept on disk under a key of the code that compiles it (runtime/aot/result_cache.py), so a
second run compiles only what changed. `--json FILE` writes the results (tests/test_aot_compile.py reads them);
the exit status is 1 if any configuration does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from k2trt.config import K2Config
from k2trt.graphs import contracts
from k2trt.graphs.fp8 import PER_TOKEN_GROUP, WEIGHT_DEQUANT
from k2trt.runtime.aot.compile_one import ARCH, PTX, _compile_dict, launch_dict, launch_from_dict

CONFIGS = ("tiny", "kimi-k2", "tiny-int4", "kimi-k2-thinking")  # FP8 and INT4 experts (K2-Thinking's)
MODES = (WEIGHT_DEQUANT, PER_TOKEN_GROUP)


@dataclass(frozen=True)
class Request:
    """One launch a plugin node would ask for: where it comes from, and the launch."""
    source: str  # "tiny moe_block", "doctor case", ...
    op_type: str
    tactic: int
    launch: object

    @property
    def label(self) -> str:
        return f"{self.source}: {self.op_type} {self.launch.label} tactic {self.tactic}"


def node_requests(source: str, op_type: str, act: str | None, aq: int, sizes: dict) -> list[Request]:
    from k2trt.runtime.aot.nodes import AOT_NODES

    row = AOT_NODES[op_type]
    return [Request(source, op_type, t, row.launch(act, aq, t, sizes)) for t in row.every_tactic()]


def graph_requests(cfg_name: str, act: str, aq: int, expert_ranges: int = 1, expert_parallel: int = 1
                   ) -> list[Request]:
    """Every launch of every plugin node in a config's TensorRT-bound graphs (export/trt_form.py: both forms of the
    kinds with attention, the routed experts in `expert_ranges` ranges; with `expert_parallel` E, the MoE block's
    parts for E ranks). A node with no AOT form in `act` (AotNode.acts) runs JIT and asks for no launch."""
    import onnx

    from k2trt.dtypes import BY_ONNX
    from k2trt.export.onnx_ops import dims, value_types
    from k2trt.export.trt_form import forms, tensorrt_graph
    from k2trt.runtime.aot.nodes import AOT_NODES
    from k2trt.runtime.tensorrt.plugins import check_input_dtypes

    cfg = K2Config.preset(cfg_name)
    out = []
    source = cfg_name + ("" if expert_ranges == 1 else f" in {expert_ranges} expert ranges") + \
        ("" if expert_parallel == 1 else f" at EP {expert_parallel}")
    kinds = ("moe_experts", "moe_combine") if expert_parallel > 1 else \
        ("dense_block", "moe_block") if expert_ranges == 1 else ("moe_block",)  # no plugin elsewhere
    experts = cfg.n_routed_experts // expert_parallel
    for kind, form in [(k, f) for k in kinds for f in forms(k)]:
        model = tensorrt_graph(cfg, kind, act, aq, experts, expert_ranges, form)
        types = value_types(model)
        for node in model.graph.node:
            if node.domain != contracts.NAMESPACE:
                continue
            ports = [p.name for p in contracts.CONTRACTS[node.op_type].inputs]
            shapes = {p: dims(types[v]) for p, v in zip(ports, node.input)}
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            sizes = AOT_NODES[node.op_type].sizes_of(lambda i, axis: shapes[i][axis], attrs.__getitem__)
            node_act = check_input_dtypes(node.op_type, [BY_ONNX[types[v].elem_type].name for v in node.input],
                                          attrs)
            if AOT_NODES[node.op_type].has_aot(node_act):
                label = f"{source} {kind}" + ("" if form == "decode" else f" ({form})")
                out += node_requests(label, node.op_type, node_act, aq, sizes)
    return out


def case_requests(act: str, aq: int) -> list[Request]:
    """The launches of `k2trt doctor`'s one-node cases (runtime/tensorrt/plugin_cases.py), sizes as the plugins read
    them from the cases' inputs."""
    from k2trt.runtime.tensorrt.plugin_cases import node_cases

    from k2trt.runtime.aot.nodes import AOT_NODES

    out = []
    for case in node_cases(act, aq):
        if AOT_NODES[case.op_type].has_aot(case_activation(case)):
            out += node_requests("doctor case", case.op_type, case_activation(case), aq, case_sizes(case))
    return out


def case_activation(case) -> str | None:
    return None if case.op_type == "MoeAlign" else case.act


def case_sizes(case) -> dict:
    from k2trt.runtime.aot.nodes import AOT_NODES

    return AOT_NODES[case.op_type].sizes_of(lambda i, axis: int(case.inputs[i].shape[axis]), case.attrs.__getitem__)


# K2's fallback for a TensorRT that refuses plugin inputs over 2^31 elements (export --expert-ranges 3); doctor's
# K2-size cases (plugin_cases.large_case: 384 experts and one range of 128) have these graphs' sizes
RANGED = {"kimi-k2": 3}
# the expert-parallel parts (export --expert-parallel E): their kernels are the block's, specialized on the rank's
# expert count (and a top-1 combine); one E per config — the tests' for the tiny ones, the README's EP 8 for K2
# in bfloat16, the dtype engines are built in (the kernels' fit per dtype is the whole blocks' to check)
EXPERT_PARALLEL = {"tiny": 2, "tiny-int4": 2, "kimi-k2": 8, "kimi-k2-thinking": 8}
EXPERT_PARALLEL_DTYPE = "bfloat16"


@functools.lru_cache(maxsize=4)  # building K2's graphs takes seconds; the table is the same for the same arguments
def all_requests(configs=CONFIGS, dtypes=contracts.ACTIVATION_DTYPES, modes=MODES, cases: bool = True
                 ) -> tuple[Request, ...]:
    out = []
    for act in dtypes:
        for aq in modes:
            for name in configs:
                out += graph_requests(name, act, aq)
                if name in RANGED:
                    out += graph_requests(name, act, aq, RANGED[name])
                if name in EXPERT_PARALLEL and act == EXPERT_PARALLEL_DTYPE:
                    out += graph_requests(name, act, aq, expert_parallel=EXPERT_PARALLEL[name])
            if cases:
                out += case_requests(act, aq)
    return tuple(out)


def distinct(requests: list[Request]) -> dict[tuple, Request]:
    """One request per compiled configuration (the first met), by aot.config_key."""
    out: dict[tuple, Request] = {}
    for r in requests:
        out.setdefault(r.launch.config_key(), r)
    return out


# ---- compiling (in worker processes: TRITON_INTERPRET must be off before triton is imported) ---------------------

def compile_all(launches: list, workers: int = 2, arch: int = ARCH, ptx: int | None = PTX, log=None,
                cache=None) -> list[dict]:
    """compile_one for every launch, on `workers` processes (each compile is one core's work); with a
    ResultCache (aot_cache.py), a launch compiled before by the same code is read, not compiled, and each new
    result is stored (marked "cached": true when read)."""
    import multiprocessing

    jobs = [(launch_dict(x), arch, ptx) for x in launches]
    results: list[dict | None] = [cache.get(j) if cache is not None else None for j in jobs]
    for r in results:
        if r is not None:
            r["cached"] = True
    missing = [i for i, r in enumerate(results) if r is None]
    if len(missing) <= 1 or workers <= 1:
        compiled = [_compile_dict(jobs[i]) for i in missing]
    else:
        with ProcessPoolExecutor(min(workers, len(missing)), mp_context=multiprocessing.get_context("spawn")) as pool:
            compiled = list(pool.map(_compile_dict, [jobs[i] for i in missing]))
    for i, r in zip(missing, compiled):
        results[i] = r
        if cache is not None and not r["error"]:  # a failure is compiled again, so its message is always today's
            cache.put(jobs[i], r)
    if log:
        for r in results:
            log(result_line(r))
    return results


def results_by_key(results: list[dict]) -> dict[tuple, dict]:
    """Results indexed by the compiled configuration of the launch each was compiled for."""
    return {launch_from_dict(r["requested"]).config_key(): r for r in results}


TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def compiled_like(launch, result: dict):
    """`launch` shrunk as compile_launch shrank the configuration `result` was compiled for (the shrinking depends
    on the configuration alone), so a launch of other sizes in that configuration needs no compile of its own."""
    chosen = result["chosen"]
    if chosen is None:
        raise ValueError(f"{launch.label}: {result['error']}")
    return dataclasses.replace(launch, **{f: chosen[f] for f in TILE_FIELDS if f in chosen and f in
                                          {x.name for x in dataclasses.fields(launch)}})


def result_line(r: dict) -> str:
    req = r["requested"]
    what = (f"{req['type']} {req.get('act')} aq{req.get('activation_quant')} "
            f"BM{req.get('block_m')} BN{req.get('block_n')} w{req.get('num_warps')} s{req.get('num_stages')}")
    if r["chosen"] is None:
        return f"{what}: FAIL {r['error']}"
    c = r["chosen"]
    got = (f"-> BM{c.get('block_m')} BN{c.get('block_n')} BK{c.get('block_k', 128)} s{c.get('num_stages')}: "
           f"{r['shared']} B shared, {r['registers']} regs x {r['threads']}, spills {r['spill_stores']}/"
           f"{r['spill_loads']} B, {r['seconds']} s")
    return f"{what} {got}" + (f"  FAIL {r['error']}" if r["error"] else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2trt.runtime.aot.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write every configuration's result here")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="compiling processes (default: the cores this process may run on)")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every configuration, reading and writing no stored result (runtime/aot/result_cache.py)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--dtypes", nargs="+", default=list(contracts.ACTIVATION_DTYPES),
                   choices=contracts.ACTIVATION_DTYPES)
    p.add_argument("--mla", action="store_true",
                   help="compile the paged MLA attention's launches at K2's shapes (runtime/aot/mla.py) instead")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_configs: compiles for the GPU; run it without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.mla:
        from k2trt.runtime.aot import mla as aot_mla

        acts = [a for a in args.dtypes if a in aot_mla.AOT_ACTIVATIONS]
        requests = [Request("mla K2", type(x).__name__, 0, x) for x in aot_mla.every_launch(acts)]
    else:
        requests = all_requests(tuple(args.configs), tuple(args.dtypes))
    unique = distinct(requests)
    from k2trt.runtime.aot.result_cache import ResultCache

    cache = None if args.no_cache else ResultCache()
    print(f"{len(requests)} launches, {len(unique)} distinct configurations; compiling for sm_{ARCH} "
          f"on {args.workers} processes" + ("" if cache is None else f", results kept in {cache.folder}"), flush=True)
    results = compile_all([r.launch for r in unique.values()], args.workers, log=lambda s: print(s, flush=True),
                          cache=cache)
    for r, req in zip(results, unique.values()):
        r["first_request"] = req.label
    failed = [r for r in results if r["error"]]
    if args.json:
        from k2trt.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps({"arch": ARCH, "ptx": PTX, "results": results}, indent=1))
    reused = sum(bool(r.get("cached")) for r in results)
    print(f"{len(results) - len(failed)} of {len(results)} configurations fit ({reused} read from the cache, "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
