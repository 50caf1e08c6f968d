"""One AOT launch compiled as `k2trt build` would compile it, for a GPU architecture, on a CPU: the configuration
compile_launch settles on, its shared memory and ptxas' registers and spills. What a result depends on is this
module and what it imports (runtime/aot/result_cache.py keys stored results by their sources); the table of launches
to compile is runtime/aot/sweep.py's.
"""

from __future__ import annotations

import dataclasses
import time

ARCH = 90  # Hopper (H100 / H200): K2's FP8 kernels need sm_89+, and sm_90 is what the project targets
PTX = 88  # the PTX ISA a CUDA 12.9 driver loads, the newest a cu12 TensorRT is known to take (environment.py)


def launch_dict(launch) -> dict:
    return {"type": type(launch).__name__, **dataclasses.asdict(launch)}


def launch_from_dict(d: dict):
    from k2trt.runtime.aot import linear as aot_linear
    from k2trt.runtime.aot import mla as aot_mla
    from k2trt.runtime.aot import moe as aot_moe
    from k2trt.runtime.aot import moe_int4 as aot_moe_int4

    classes = {c.__name__: c for c in (aot_linear.LinearLaunch, aot_moe.GemmLaunch, aot_moe.AlignLaunch,
                                       aot_moe.CombineLaunch, aot_moe_int4.Int4GemmLaunch, *aot_mla.LAUNCHES)}
    fields = dict(d)
    return classes[fields.pop("type")](**fields)


def compile_one(launch, arch: int = ARCH, ptx: int | None = PTX) -> dict:
    """Compile a launch as `k2trt build` would (shrinking to fit), then ptxas -v the PTX it hands TensorRT."""
    from k2trt.runtime.aot import ptx as aot

    t0 = time.perf_counter()
    result = {"requested": launch_dict(launch)}
    try:
        chosen, kernel = aot.compile_launch(launch, aot.Target(arch, ptx))
        usage = aot.ptxas_usage(kernel.ptx, arch)
        problems = usage.fits(kernel.block_x)
        result.update(chosen=launch_dict(chosen), shared=kernel.shared, threads=kernel.block_x,
                      registers=usage.registers, spill_stores=usage.spill_stores, spill_loads=usage.spill_loads,
                      error="; ".join(problems) or None)
    except Exception as e:  # noqa: BLE001 - every configuration is reported, then the run fails
        result.update(chosen=None, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _compile_dict(args) -> dict:
    return compile_one(launch_from_dict(args[0]), *args[1:])
