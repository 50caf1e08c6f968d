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


def current_environment(device: int = 0) -> dict:
    """TensorRT version, GPU and driver of this process (imports TensorRT and initializes CUDA)."""
    trt = import_tensorrt()
    torch = require_cuda()
    major, minor = torch.cuda.get_device_capability(device)
    driver = driver_cuda_version()
    return {"tensorrt_version": trt.__version__, "gpu_name": torch.cuda.get_device_name(device),
            "compute_capability": f"{major}.{minor}",
            "cuda_driver": None if driver is None else f"{driver[0]}.{driver[1]}"}


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


def ptx_version_for(driver: tuple[int, int] | None, ptxas: int | None) -> int | None:
    """The PTX ISA to emit: no newer than the driver loads nor than the ptxas Triton compiles with can check.
    (TensorRT JIT-compiles a plugin's PTX when the engine is loaded; tensorrt.plugin reports no CUDA version of
    its own, so the driver's is the binding limit.)"""
    limits = [v for v in (None if driver is None else max_ptx_for_cuda(*driver), ptxas) if v is not None]
    return min(limits) if limits else None


def tensorrt_major(version: str) -> int:
    return int(version.split(".")[0])
