import os
import signal

# Tests that press ^C (SIGINT to a child) need the child to take it as a terminal's foreground job does. A shell
# starts a background job (`make test &`, nohup) with SIGINT ignored, a disposition every child inherits and under
# which Python installs no KeyboardInterrupt handler: the child would run on. A handler here (not SIG_IGN) makes
# each exec'd child start with SIGINT at its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Triton kernels run on CPU tensors under its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep torch from oversubscribing the cores: at most two threads, and under pytest-xdist the cores shared among
# its workers (each a process of its own).
import torch  # noqa: E402

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402
from collections import Counter  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Modules with the most slow tests first, each module's tests in their own order: pytest-xdist's loadfile hands
    whole files to the workers in this order, so the long files start first and the short ones fill the end
    (longest first: no worker is left running one big file while the others are done)."""
    slow = Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: a module's tests stay together, in order


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The embedded tiny checkpoint, made once per session."""
    from fixtures import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_export(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint's graphs (float32), exported once per session."""
    from k2trt.config import K2Config
    from k2trt.export.exporter import export

    out = tmp_path_factory.mktemp("tiny-onnx")
    export(K2Config.from_json(tiny_ckpt), out, "float32", log=lambda *a: None)
    return out


@pytest.fixture(scope="session")
def aot_compiled(tmp_path_factory):
    """Every distinct AOT configuration compiled for sm_90 (runtime/aot/sweep.py, real Triton compiles and
    ptxas, in a process of its own without TRITON_INTERPRET, one compiling process per core), once per test
    session: (results, log, seconds). Results the same code compiled before are read from the machine's AOT cache
    (runtime/aot/result_cache.py: ~/.cache/k2trt/aot, or $K2TRT_AOT_CACHE)."""
    import json
    import subprocess
    import sys
    import time

    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend compiles the AOT kernels")
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "k2trt.runtime.aot.sweep", "--json", str(out)], env=env,
                       capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if not out.exists():
        pytest.fail(f"aot_configs wrote no results (exit {r.returncode}): {(r.stderr or r.stdout)[-3000:]}")
    return json.loads(out.read_text())["results"], r.stdout, seconds


@pytest.fixture(scope="session")
def tiny_int4_ckpt(tmp_path_factory):
    """The tiny K2-Thinking (make-tiny --format int4), made once per session."""
    from fixtures import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory, format="int4")


@pytest.fixture(scope="session")
def tiny_k25_ckpt(tmp_path_factory):
    """The same INT4 weights in K2.5's layout (make-tiny --format k2.5)."""
    from fixtures import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory, format="k2.5")


@pytest.fixture(scope="session")
def tiny_int4_export(tiny_int4_ckpt, tmp_path_factory):
    from k2trt.config import K2Config
    from k2trt.export.exporter import export

    out = tmp_path_factory.mktemp("tiny-int4-onnx")
    export(K2Config.from_json(tiny_int4_ckpt), out, "float32", log=lambda *a: None)
    return out


@pytest.fixture(scope="session")
def tiny_ep_exports(tiny_ckpt, tmp_path_factory):
    """export --expert-parallel E of the tiny checkpoint (float32), E = 2 and 4: {E: directory}."""
    from k2trt.config import K2Config
    from k2trt.export.exporter import export

    out = {}
    for e in (2, 4):
        out[e] = tmp_path_factory.mktemp(f"tiny-onnx-ep{e}")
        export(K2Config.from_json(tiny_ckpt), out[e], "float32", log=lambda *a: None, expert_parallel=e)
    return out
