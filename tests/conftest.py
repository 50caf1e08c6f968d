import os

# Triton kernels run on CPU tensors under its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores: keep torch from oversubscribing them when pytest-xdist is not used.
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402


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
