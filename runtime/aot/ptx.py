"""A Triton kernel compiled into what a TensorRT AOT plugin returns: (kernel name, PTX, launch width, shared bytes).

TensorRT's rules for the PTX (tensorrt/plugin/_plugin_class.py _TemplateAOTPlugin, include/impl/NvInferPythonPlugin.h):
  * it launches the kernel with exactly (input pointers..., extra int32 scalars..., output pointers...), so
    Triton's hidden scratch parameters (Triton >= 3.3) are stripped, and a kernel that reads them is refused;
  * shared_mem is "the dynamic shared-memory per thread block"; TensorRT documents no way to raise a kernel's
    limit above the 48 KiB every CUDA launch gets without cudaFuncSetAttribute (CUDA C++ Programming Guide,
    "Shared Memory"), so launches shrink until they fit AOT_SHARED_LIMIT;
  * the PTX is JIT-compiled where the engine is loaded: its `.version` must not exceed the PTX ISA the driver
    accepts (PTX ISA release notes: CUDA 12.x accepts up to 8.x, 13.0 up to 9.0), chosen by the builder
    (runtime/tensorrt/environment.max_ptx_version) and set with `configure`;
  * every entry name is unique (launch digest + a sequence number): one engine holds many plugins' kernels, and
    nothing in TensorRT's documentation says they live in separate modules.
Pointers are declared 16-byte divisible (`tt.divisibility`, as triton/tools/compile.py declares them), which lets
Triton vectorize loads and pipeline them with cp.async; TensorRT requires bound tensors to be 256-byte aligned
(NvInferRuntime.h, IExecutionContext::setTensorAddress).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass, replace

import triton

from k2trt.runtime.kernels.fp8_linear import FP_FUSION

AOT_SHARED_LIMIT = 48 * 1024
ENTRY_PREFIX = "k2trt_"


@dataclass(frozen=True)
class Target:
    arch: int  # compute capability as Triton spells it: 90 for sm_90
    ptx_version: int | None = None  # PTX ISA as Triton spells it (90 = ".version 9.0"); None: Triton's own choice


@dataclass(frozen=True)
class AotKernel:
    name: str
    ptx: str
    block_x: int
    shared: int


_target: Target | None = None
_sequence = itertools.count()


def configure(target: Target | None) -> None:
    """The target every AOT kernel of this process compiles for (k2trt build sets it from the GPU and driver)."""
    global _target
    _target = target


def signature(kernel, pointer_types: dict[str, str], constexprs: dict) -> tuple[dict, dict]:
    """Triton's (signature, attrs) for a kernel: the named pointers, every other runtime parameter an i32, each
    pointer 16-byte divisible."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = "*" + pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    missing = set(pointer_types) - set(kernel.arg_names)
    if missing:
        raise ValueError(f"{kernel.__name__} has no parameters {sorted(missing)}")
    return sig, attrs


def strip_unused_params(ptx: str, kernel: str, keep: int) -> str:
    """Drop the entry parameters after the first `keep` if the body never reads them."""
    head = re.search(r"\.entry\s+" + re.escape(kernel) + r"\s*\(", ptx)
    if head is None:
        raise ValueError(f"kernel {kernel!r} not found in the PTX")
    close = ptx.index(")", head.end())
    params = [p.strip() for p in ptx[head.end():close].split(",") if p.strip()]
    if len(params) < keep:
        raise ValueError(f"kernel {kernel!r} has {len(params)} parameters, expected at least {keep}")
    body = ptx[close:]
    for p in params[keep:]:
        name = p.split()[-1]
        if re.search(re.escape(name) + r"\b", body):
            raise ValueError(f"kernel {kernel!r} reads its extra parameter {name}; cannot launch it from TensorRT")
    inner = ",\n".join("\t" + p for p in params[:keep])
    return ptx[:head.end()] + "\n" + inner + "\n" + ptx[close:]


def rename_entry(ptx: str, old: str, new: str) -> str:
    """The PTX with its entry (and the entry's parameter names, `<entry>_param_<i>`) called `new`."""
    renamed = re.sub(r"(?<![\w$.])" + re.escape(old) + r"(?=_param_\d|[^\w$])", new, ptx)
    if not re.search(r"\.entry\s+" + re.escape(new) + r"\s*\(", renamed):
        raise ValueError(f"kernel {old!r} not found in the PTX")
    return renamed


def ptx_version_of(ptx: str) -> tuple[int, int]:
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, flags=re.MULTILINE)
    if m is None:
        raise ValueError("the PTX declares no .version")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=None)
def _compile(launch, target: Target | None):
    """(entry name, PTX, warps, shared bytes) of a launch, parameters stripped; cached per launch and target."""
    from triton.backends.compiler import GPUTarget

    kernel, constexprs = launch.kernel, launch.constexprs()
    sig, attrs = signature(kernel, launch.pointer_types(), constexprs)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    # FMA contraction set explicitly, as every JIT launch sets it (fp8_linear.FP_FUSION): Triton's default flips in 3.10
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "enable_fp_fusion": FP_FUSION}
    if target is not None and target.ptx_version is not None:
        options["ptx_version"] = target.ptx_version
    compiled = triton.compile(src, target=None if target is None else GPUTarget("cuda", target.arch, 32),
                              options=options)
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise ValueError(f"{launch.label}: the kernel needs Triton scratch memory, which TensorRT cannot provide")
    runtime_params = sum(1 for v in sig.values() if v != "constexpr")
    return md.name, strip_unused_params(compiled.asm["ptx"], md.name, runtime_params), md.num_warps, md.shared


def shrink_tiles(launch, narrow_n: bool = True):
    """The next smaller config of a GEMM launch, or None: fewer stages, then (where `narrow_n`) narrower N down to
    32, then fewer rows down to 16."""
    if launch.num_stages > 1:
        return replace(launch, num_stages=launch.num_stages - 1)
    if narrow_n and launch.block_n > 32:
        return replace(launch, block_n=launch.block_n // 2, num_stages=2)
    if launch.block_m > 16:
        return replace(launch, block_m=launch.block_m // 2, num_stages=2)
    return None


def config_key(launch, k: int, block_k: int, kind: tuple) -> tuple:
    """A GEMM launch's compiled configuration: everything its code depends on besides the exact sizes — the kernel,
    its types and mode (`kind`), tiles, warps and stages, whether K is whole K steps (the masked tail) and whether
    the K loop is shorter than the pipeline (which then holds fewer stages). N only bounds the grid and the masks."""
    tiles = (launch.block_m, launch.block_n, block_k, launch.num_warps, launch.num_stages)
    return (launch.kernel.__name__, *kind, *tiles, k % block_k == 0, -(-k // block_k) < launch.num_stages)


def _target_arch(target: Target | None) -> int:
    if target is not None:
        return target.arch
    return int(triton.runtime.driver.active.get_current_target().arch)  # Triton's own target: the current GPU


def compile_launch(launch, target: Target | None = None):
    """Compile a launch, shrinking it until it fits AOT_SHARED_LIMIT and the register file unspilled ->
    (the launch compiled, AotKernel).

    Spills count as not fitting because they depend on more than the tiles: MoeGateUp bf16 W8A8 at 64 rows, one
    stage, compiles to 255 registers with 384 experts and spills 24 B with 48 (Kimi K2 at EP 8; E sets BLOCK_E and
    the weight offsets) — ptxas -v on the PTX tells, and costs one ptxas run per launch compiled.
    A launch is a frozen dataclass with: label, kernel, pointer_types(), constexprs(), num_warps, num_stages,
    shrink() (the next smaller config, or None)."""
    target = target if target is not None else _target
    first, why = launch, []
    while launch is not None:
        name, ptx, warps, shared = _compile(launch, target)
        if shared > AOT_SHARED_LIMIT:
            why = [f"{shared} B of shared memory"]
        else:
            why = ptxas_usage(ptx, _target_arch(target)).fits(warps * 32)
            if not why:
                digest = hashlib.sha256(repr((launch, target)).encode()).hexdigest()[:10]
                unique = f"{ENTRY_PREFIX}{launch.label}_{digest}_{next(_sequence)}"
                return launch, AotKernel(unique, rename_entry(ptx, name, unique), warps * 32, shared)
        launch = launch.shrink()
    raise ValueError(f"{first.label}: no tile config fits in {AOT_SHARED_LIMIT // 1024} KiB of shared memory and "
                     f"the register file unspilled (the smallest: {'; '.join(why)})")


# ---- what ptxas says of a compiled kernel ---------------------------------------------------------------------
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (9.0): at most 255 32-bit registers
# per thread and 64 K per thread block — a launch needing more is refused; ptxas spills what does not fit in 255.
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 64 * 1024


@dataclass(frozen=True)
class PtxasUsage:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int
    stack: int  # bytes of stack frame

    def fits(self, threads: int) -> list[str]:
        """Why a block of `threads` threads would not run as compiled (empty: it fits, unspilled)."""
        problems = []
        if self.registers > MAX_REGISTERS_PER_THREAD or self.registers * threads > REGISTERS_PER_BLOCK:
            problems.append(f"{self.registers} registers x {threads} threads exceed the register file")
        if self.spill_stores or self.spill_loads:
            problems.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        return problems


@functools.lru_cache(maxsize=256)
def ptxas_usage(ptx: str, arch: int) -> PtxasUsage:
    """`ptxas -v` on a kernel's PTX — what TensorRT's JIT compiles — with Triton's bundled ptxas, the options Triton
    passes it (triton/backends/nvidia/compiler.py make_cubin: --fmad follows enable_fp_fusion). No GPU needed."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory(prefix="k2trt-ptxas-") as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", *([] if FP_FUSION else ["--fmad=false"]),
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.cubin")]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"ptxas failed: {' '.join((r.stderr or r.stdout).split())[:300]}")
    log = r.stderr + r.stdout
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if used is None or spills is None:
        raise ValueError(f"cannot read ptxas -v: {' '.join(log.split())[:300]}")
    stack, stores, loads = (int(g) for g in spills.groups())
    return PtxasUsage(int(used.group(1)), stores, loads, stack)
