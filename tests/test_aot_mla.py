"""The paged MLA attention's AOT launches (runtime/aot/mla.py), compiled for sm_90 on the CPU (`python -m
k2trt.runtime.aot.sweep --mla`: Triton's compiler and bundled ptxas in a process without TRITON_INTERPRET, no GPU).
At K2's shapes, bf16 and fp16 activations over a pool of that dtype and an fp8 pool, each launch must fit the 48 KiB
of shared memory an AOT launch gets and the register file unspilled, shrinking its tiles until it does; then the
tiles it settled on must compute the attention — run under the interpreter against the dense reference, the step's
rows dense as a block graph passes them — so a shrink can never trade correctness for fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the AOT compiles need the triton package (pip install triton)")

from test_kernels_mla import FP8, _check_new, _paged  # noqa: E402
from test_kernels_mla_prefill import _case, _check  # noqa: E402

from k2trt.runtime.aot import mla as aot_mla  # noqa: E402
from k2trt.runtime.aot.compile_one import launch_dict  # noqa: E402
from k2trt.runtime.aot import ptx as aot  # noqa: E402
from k2trt.runtime.kernels import mla_decode, mla_prefill  # noqa: E402


@pytest.fixture(scope="module")
def mla_compiled(tmp_path_factory):
    """Every MLA launch compiled (results the same code compiled before read from the machine's AOT cache)."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend compiles the AOT kernels")
    out = tmp_path_factory.mktemp("aot_mla") / "mla.json"
    r = subprocess.run([sys.executable, "-m", "k2trt.runtime.aot.sweep", "--mla", "--json", str(out)],
                       env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        pytest.fail(f"the MLA sweep wrote no results (exit {r.returncode}): {(r.stderr or r.stdout)[-3000:]}")
    return json.loads(out.read_text())["results"]


@pytest.mark.slow  # compiles (~3 s a launch, once per version of the kernels)
def test_every_launch_fits_shared_memory_and_registers(mla_compiled):
    asked = {json.dumps(launch_dict(x), sort_keys=True) for x in aot_mla.every_launch()}
    assert {json.dumps(r["requested"], sort_keys=True) for r in mla_compiled} == asked
    bad = [f"{r['requested']}: {r['error']}" for r in mla_compiled if r["error"]]
    assert not bad, "\n".join(bad)
    for r in mla_compiled:
        assert 0 <= r["shared"] <= aot.AOT_SHARED_LIMIT, r
        assert r["registers"] * r["threads"] <= aot.REGISTERS_PER_BLOCK and r["spill_stores"] == 0, r


@pytest.mark.slow  # interprets at the compiled tiles
def test_the_compiled_tiles_compute_the_attention(mla_compiled):
    """bf16 activations over an fp8 pool, each kernel at the tiles its launch compiled with (shrunk from the JIT
    defaults, which do not fit): the decode split in both forms, the prefill's two kernels."""
    chosen = {}
    for r in mla_compiled:
        req = r["requested"]
        if req["act"] == "bfloat16" and req.get("pool") == "float8_e4m3fn":
            chosen[req["type"]] = r["chosen"]
    split, decompress, attend = chosen["SplitLaunch"], chosen["DecompressLaunch"], chosen["AttendLaunch"]
    config = mla_decode.MlaDecodeConfig(split["block_m"], split["block_n"], split["num_warps"], split["num_stages"])
    assert config != mla_decode.DEFAULT_CONFIG, "the JIT tiles fit after all: then the plugin should keep them"

    small = dict(heads=4, latent=512, rope=64)
    case = _paged([63, 0, 129], 3, **small, q_dtype=torch.bfloat16, pool_dtype=FP8, seed=41)
    new = torch.randn(3, 3, 576, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    for splits in (1, 3):
        _check_new(case, new, torch.tensor([3, 2, 1], dtype=torch.int32), splits=splits, config=config)

    prefill = mla_prefill.MlaPrefillConfig(
        decompress_p=decompress["block_p"], decompress_n=decompress["block_n"], decompress_k=decompress["block_k"],
        decompress_warps=decompress["num_warps"], block_m=attend["block_m"], block_n=attend["block_n"],
        num_warps=attend["num_warps"], num_stages=attend["num_stages"])
    case = _case([63, 0, 129], [5, 5, 2], **small, nope=64, v=64, q_dtype=torch.bfloat16, pool_dtype=FP8, seed=43)
    new = torch.randn(3, 5, 576, generator=torch.Generator().manual_seed(44)).to(torch.bfloat16)
    _check(case, 64, new=new, config=prefill)


def test_the_launches_take_the_caches_pages():
    from k2trt.runtime.cache.pages import PAGE_TOKENS

    assert aot_mla.k2_shape()["page_tokens"] == PAGE_TOKENS


def test_launches_refuse_what_has_no_aot_form():
    """A pool of another dtype than the activations' (or fp8), and float32 activations (no tile fits 48 KiB)."""
    shape = aot_mla.k2_shape()
    with pytest.raises(ValueError, match="a pool holds the activation dtype"):
        aot_mla.launches("bfloat16", "float32", **shape)[0].pointer_types()
    with pytest.raises(ValueError, match="no launch for float32"):
        aot_mla.every_launch(("float32",))
