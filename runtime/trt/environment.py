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
                                "(Python plugins need TensorRT >= 10.10)") from None
    return trt, trtp


def require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise MissingDependency("no CUDA GPU is visible to torch (TensorRT engines are built and run on an "
                                "NVIDIA GPU; install a CUDA build of torch: make install EXTRAS=gpu,dev TORCH=torch)")
    return torch


def current_environment(device: int = 0) -> dict:
    """TensorRT version and GPU of this process (imports TensorRT and initializes CUDA)."""
    trt = import_tensorrt()
    torch = require_cuda()
    major, minor = torch.cuda.get_device_capability(device)
    return {"tensorrt_version": trt.__version__, "gpu_name": torch.cuda.get_device_name(device),
            "compute_capability": f"{major}.{minor}"}


def tensorrt_major(version: str) -> int:
    return int(version.split(".")[0])
