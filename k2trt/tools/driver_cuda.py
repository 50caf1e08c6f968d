"""`python3 k2trt/tools/driver_cuda.py`: the TensorRT wheel flavour this machine's NVIDIA driver takes — "cu13" on a
CUDA 13 driver, "cu12" on a CUDA 12 one or without a driver (CPU machines never use it) — for the Makefile, which
runs it with the system Python before the venv exists, so it uses the standard library only (cuDriverGetVersion,
as runtime/tensorrt/environment.driver_cuda_version)."""

import ctypes
import sys


def wheel_flavour() -> str:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "cu12"
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return "cu12"
    return "cu13" if v.value // 1000 >= 13 else "cu12"


if __name__ == "__main__":
    print(wheel_flavour())
    sys.exit(0)
