"""What this machine offers the TensorRT path: the TensorRT module (and its Python plugin API), a CUDA GPU, and
their versions. Every import of TensorRT goes through here, lazily, so that without it each command says in one
line what is missing instead of failing at import."""

from __future__ import annotations

from k2trt.errors import MissingDependency

INSTALL_HINT = "pip install 'k2trt[gpu]' on an NVIDIA machine"


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise MissingDependency(f"TensorRT is not installed ({INSTALL_HINT})") from None
    except OSError as e:  # the bindings are present but libnvinfer is not
        raise MissingDependency(f"TensorRT failed to load: {str(e).splitlines()[0]} ({INSTALL_HINT})") from None
    return tensorrt


def import_tensorrt_plugin():
    trt = import_tensorrt()
    try:
        import tensorrt.plugin as trtp
    except ImportError:
        raise MissingDependency(f"TensorRT {trt.__version__} has no tensorrt.plugin module "
                                "(Python plugins need TensorRT >= 10.6)") from None
    return trt, trtp


def require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise MissingDependency("no CUDA GPU is visible to torch (TensorRT engines are built and run on an "
                                "NVIDIA GPU; install a CUDA build of torch: "
                                "make install EXTRAS=gpu,serve,dev TORCH=torch)")
    return torch


# TensorRT versions k2trt supports (pyproject.toml's gpu extras say the same): 10.15 is the first whose
# tensorrt.plugin resets SymIntExpr._exprBuilder after each shape call (_plugin_class.py get_output_shapes and
# get_launch_params, v10.15), which MoeAlign's [E + 1] output relies on; 11.x is checked against the stand-in
# (its tensorrt.plugin is 10.16's, its network flags moved: runtime/engines/builder.network_flags).
TENSORRT_SUPPORTED = ((10, 15), (12, 0))  # [first, first unsupported)


def tensorrt_wheel_cuda() -> int | None:
    """The CUDA major version the installed TensorRT wheel is built for, from its distribution's name (TensorRT's
    python/packaging/tensorrt_build_backend: tensorrt_cu{major}, _bindings, _libs); None if it cannot tell."""
    import re
    from importlib import metadata

    for dist in metadata.distributions():
        m = re.fullmatch(r"tensorrt[-_]cu(\d+)(?:[-_](?:bindings|libs))?", (dist.metadata["Name"] or "").lower())
        if m:
            return int(m.group(1))
    return None


def current_environment(device: int = 0) -> dict:
    """TensorRT version, GPU and driver of this process (imports TensorRT and initializes CUDA)."""
    trt = import_tensorrt()
    torch = require_cuda()
    major, minor = torch.cuda.get_device_capability(device)
    driver = driver_cuda_version()
    return {"tensorrt_version": trt.__version__, "tensorrt_cuda": tensorrt_wheel_cuda(),
            "gpu_name": torch.cuda.get_device_name(device), "compute_capability": f"{major}.{minor}",
            "cuda_driver": None if driver is None else f"{driver[0]}.{driver[1]}"}


def check_tensorrt(version: str, wheel_cuda: int | None, driver: tuple[int, int] | None) -> str | None:
    """Why this TensorRT cannot serve k2trt here (one line), or None: its version in TENSORRT_SUPPORTED, and a
    wheel built for a CUDA no newer than the driver (a cu13 TensorRT needs a CUDA 13 driver; a cu12 one runs on
    12.x and 13.x drivers)."""
    (lo, hi), v = TENSORRT_SUPPORTED, tuple(int(x) for x in version.split(".")[:2])
    if not lo <= v < hi:
        return (f"TensorRT {version} is outside what k2trt supports (>= {lo[0]}.{lo[1]}, < {hi[0]}); "
                f"pip install 'tensorrt-cu12>={lo[0]}.{lo[1]},<{hi[0]}' or 'tensorrt-cu13...'")
    if wheel_cuda is not None and driver is not None and wheel_cuda > driver[0]:
        return (f"TensorRT is built for CUDA {wheel_cuda} (tensorrt-cu{wheel_cuda}) but the driver is CUDA "
                f"{driver[0]}.{driver[1]}: make install EXTRAS=gpu picks tensorrt-cu{driver[0]} for this driver")
    return None


# ---- the PTX an AOT plugin may carry ------------------------------------------------------------------------

def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version of the installed driver (cuDriverGetVersion), or None without a driver."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value // 1000, (v.value % 1000) // 10


def max_ptx_for_cuda(major: int, minor: int) -> int:
    """The newest PTX ISA (Triton's spelling: 88 = 8.8) a CUDA version's driver JIT accepts, from the PTX ISA
    release notes: CUDA 12.0–12.5 bring PTX 8.0–8.5, 12.6 none, 12.7–12.9 PTX 8.6–8.8, 13.x PTX 9.x."""
    if major >= 13:
        return 90 + 10 * (major - 13) + minor
    if major == 12:
        return 80 + (minor if minor < 6 else minor - 1)
    if major == 11:
        return 70 + minor
    raise ValueError(f"CUDA {major}.{minor} is older than TensorRT 10 supports")


def ptx_text(version: int) -> str:
    """A PTX ISA version as PTX spells it: 88 -> "8.8"."""
    return f"{version // 10}.{version % 10}"


def triton_ptx_version(arch: int) -> int | None:
    """The PTX ISA Triton's bundled ptxas handles (Triton's own default), or None if this Triton cannot say."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

        return ptx_get_version(get_ptxas(arch).version)
    except Exception:  # noqa: BLE001 - an internal of Triton's: without it the driver's limit alone applies
        return None


# The newest CUDA minor of each major, whose PTX ISA caps a TensorRT wheel built for that major (12.9: PTX 8.8).
LAST_MINOR = {12: 9}


def ptx_version_for(driver: tuple[int, int] | None, ptxas: int | None, wheel_cuda: int | None = None) -> int | None:
    """The PTX ISA to emit: no newer than the driver loads, than the ptxas Triton compiles with can check, nor —
    while it is not known who JIT-compiles a plugin's PTX when TensorRT loads the engine (the driver, or a PTX
    compiler inside TensorRT's own libraries) — than the newest CUDA of the TensorRT wheel's major can (a cu12
    TensorRT: PTX 8.8, even on a CUDA 13 driver that loads 9.x)."""
    wheel = max_ptx_for_cuda(wheel_cuda, LAST_MINOR[wheel_cuda]) if wheel_cuda in LAST_MINOR else None
    limits = [v for v in (None if driver is None else max_ptx_for_cuda(*driver), ptxas, wheel) if v is not None]
    return min(limits) if limits else None


def tensorrt_major(version: str) -> int:
    return int(version.split(".")[0])
