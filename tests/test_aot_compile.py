"""Every distinct AOT configuration the plugins can ask TensorRT for, compiled for sm_90 on the CPU (Triton's
compiler and bundled ptxas, no GPU): every node kind of runtime/aot/nodes.py, float32 / bfloat16 / float16,
W8A16 and W8A8, the tiny and K2 graphs with FP8 and with INT4 experts and k2trt doctor's cases, every tactic. Each
must fit the 48 KiB of shared memory an AOT launch gets and the register file, without a spill. The interpreter's
emulation cannot see either (a compile is needed), which is how MoeGateUp float32 W8A16 once needed 73,728 B and
failed every doctor run, and how 25 INT4 float32 / float16 configurations spilled until their tile rule.

The compiles run once per session (conftest.aot_compiled: runtime/aot/sweep.py, a process per core); launches
that compile to the same code are compiled once (aot.config_key), and once per version of the code that compiles
them (runtime/aot/result_cache.py keeps each result on disk)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from k2trt.graphs import contracts
from k2trt.runtime.aot import ptx as aot
from k2trt.runtime.aot.nodes import AOT_NODES
from k2trt.runtime.aot import sweep as AC



@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_the_table_covers_every_plugin_node_kind_dtype_mode_and_config():
    requests = AC.all_requests()
    kinds = {(r.op_type, getattr(r.launch, "act", None), getattr(r.launch, "activation_quant", None))
             for r in requests}
    w4a16 = {c.op_type for c in contracts.MOE_INT4_STAGES} - {"MoeAlign", "MoeCombine"}  # no FP8 mode applies
    no_mode = {"MoeCombine", *w4a16, *(c.op_type for c in contracts.MLA_STAGES)}  # no FP8 mode applies
    for op, row in AOT_NODES.items():
        for act in contracts.ACTIVATION_DTYPES:
            for aq in AC.MODES:
                want = (op, None, None) if op == "MoeAlign" else (op, act, None) if op in no_mode else (op, act, aq)
                # a node with no AOT form in a dtype (the MLA stages in float32) runs JIT: no launch asked for
                assert (want in kinds) == row.has_aot(act), want
    assert not AOT_NODES["MlaDecodeSplit"].has_aot("float32") and AOT_NODES["MlaDecodeSplit"].has_aot("bfloat16")
    assert set(AOT_NODES) == {c.op_type for c in contracts.TENSORRT}
    assert {r.source.split()[0] for r in requests} == {*AC.CONFIGS, "doctor"}
    assert {r.source for r in requests if " at EP " in r.source} == {
        f"{name} at EP {e} {kind}" for name, e in AC.EXPERT_PARALLEL.items() for kind in ("moe_experts", "moe_combine")}
    # every tactic of every node is asked for
    for op, row in AOT_NODES.items():
        assert {r.tactic for r in requests if r.op_type == op} == set(row.every_tactic())


@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_every_distinct_configuration_fits_shared_memory_and_registers(aot_compiled):
    results, log, seconds = aot_compiled
    unique = AC.distinct(AC.all_requests())
    by_key = AC.results_by_key(results)
    assert set(by_key) == set(unique), "the compile run and the table disagree on the configurations"
    bad = [AC.result_line(r) + f"  [{r['first_request']}]" for r in results if r["error"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert 0 <= r["shared"] <= aot.AOT_SHARED_LIMIT, AC.result_line(r)
        assert r["registers"] <= aot.MAX_REGISTERS_PER_THREAD, AC.result_line(r)
        assert r["registers"] * r["threads"] <= aot.REGISTERS_PER_BLOCK, AC.result_line(r)
        assert r["spill_stores"] == r["spill_loads"] == 0, AC.result_line(r)
    print(f"{len(results)} configurations compiled in {seconds:.0f} s")


@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_moe_gate_up_fp32_w8a16_fits_after_the_tiling_fix(aot_compiled):
    """The issue's certain failure: every MoeGateUp float32 W8A16 tactic now compiles within 48 KiB, unspilled, at
    the FMA K step."""
    from k2trt.runtime.kernels.fp8_linear import FMA_BLOCK_K

    results, _, _ = aot_compiled
    gate_up = [r for r in results if r["requested"]["type"] == "GemmLaunch" and r["requested"]["stage"] == "gate_up"
               and r["requested"]["act"] == "float32" and r["requested"]["activation_quant"] == 0]
    assert gate_up and all(r["error"] is None for r in gate_up)
    assert {r["chosen"]["block_k"] for r in gate_up} == {FMA_BLOCK_K}
    assert {r["chosen"]["block_m"] for r in gate_up} == {16, 32, 64}  # no tactic lost its height


@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_the_old_tiling_does_not_fit():
    """What the fix changed: at K steps of 128 (the tiling before it) even the smallest MoeGateUp float32 W8A16
    configuration — 16 rows, one stage — needs 73,728 B of shared memory, so compile_launch finds none."""
    code = textwrap.dedent("""
        from dataclasses import replace
        from k2trt.runtime.aot import ptx as aot
        from k2trt.runtime.aot import moe as aot_moe
        launch = replace(aot_moe.gemm_launch("gate_up", 384, 2048, 7168, "float32", 0, 1), block_k=128)
        smallest = replace(launch, num_stages=1)
        print("smallest", aot._compile(smallest, aot.Target(90, 88))[3])
        try:
            aot.compile_launch(launch, aot.Target(90, 88))
        except ValueError as e:
            print("refused:", e)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "smallest 73728" in r.stdout
    assert "refused: moe_gate_up_384x2048x7168: no tile config fits in 48 KiB" in r.stdout


@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_every_int4_configuration_fits_as_its_tile_rule_chose_it(aot_compiled):
    """The INT4 GEMMs (MoeGateUpInt4, MoeDownInt4) in float32, bfloat16 and float16, every tactic, at the tiny and
    K2-Thinking shapes and doctor's: each fits as moe_int4.int4_tiles chose it — compile_launch shrank nothing — so
    the JIT entry points (which never shrink) and the plugins run the same tiles; float32 at the FMA K step, every
    tactic at its height. (Before the rule, 25 of them spilled, up to ~17 KB, and tactic 3 ran one stage.)"""
    from k2trt.runtime.kernels.fp8_linear import FMA_BLOCK_K

    results, _, _ = aot_compiled
    int4 = [r for r in results if r["requested"]["type"] == "Int4GemmLaunch"]
    assert {(r["requested"]["act"], r["requested"]["stage"]) for r in int4} == {
        (act, stage) for act in contracts.ACTIVATION_DTYPES for stage in ("gate_up", "down")}
    for r in int4:
        assert r["error"] is None and r["chosen"] == r["requested"], AC.result_line(r)
    for act in contracts.ACTIVATION_DTYPES:
        assert {r["chosen"]["block_m"] for r in int4 if r["requested"]["act"] == act} == {16, 32, 64}, act
    assert {r["chosen"]["block_k"] for r in int4 if r["requested"]["act"] == "float32"} == {FMA_BLOCK_K}


@pytest.mark.slow  # compiles (or builds the launch table from K2's graphs)
def test_int4_fp32_at_a_k_step_of_64_spills():
    """What the INT4 tile rule changed for float32: the FMA dot's fp32 operand tiles at the 16-bit K step of 64
    spill even at the smallest tactic (16 rows), with shared memory to spare."""
    code = textwrap.dedent("""
        from dataclasses import replace
        from k2trt.runtime.aot import ptx as aot
        from k2trt.runtime.aot import moe_int4 as aot_moe_int4
        launch = replace(aot_moe_int4.int4_gemm_launch("gate_up", 384, 2048, 7168, 32, "float32", 1), block_k=64)
        name, ptx, warps, shared = aot._compile(launch, aot.Target(90, 88))
        u = aot.ptxas_usage(ptx, 90)
        print("shared", shared, "spills", u.spill_stores, u.spill_loads)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    shared, stores = int(words[words.index("shared") + 1]), int(words[words.index("spills") + 1])
    assert shared <= aot.AOT_SHARED_LIMIT and stores > 0, r.stdout


def test_a_stored_result_is_read_instead_of_compiled_and_a_failure_is_not_stored(tmp_path, monkeypatch):
    """compile_all with a ResultCache: what the same code compiled before is read back (nothing compiles), a new
    result is stored whole, a failure is compiled again next time, an unreadable file is a miss."""
    from k2trt.runtime.aot import moe as aot_moe
    from k2trt.runtime.aot.result_cache import ResultCache

    ok, bad = (aot_moe.gemm_launch("down", 8, 64, 32, act, 0, 1) for act in ("float32", "bfloat16"))
    compiled = []

    def fake_compile(job):
        compiled.append(job[0]["act"])
        return {"requested": job[0], "chosen": job[0], "error": None if job[0]["act"] == "float32" else "too big",
                "shared": 1, "threads": 128, "registers": 32, "spill_stores": 0, "spill_loads": 0, "seconds": 0.1}

    monkeypatch.setattr(AC, "_compile_dict", fake_compile)
    cache = ResultCache(tmp_path, "code-a")
    first = AC.compile_all([ok, bad], workers=1, cache=cache)
    assert compiled == ["float32", "bfloat16"] and not any(r.get("cached") for r in first)
    again = AC.compile_all([ok, bad], workers=1, cache=cache)
    assert compiled == ["float32", "bfloat16", "bfloat16"]  # only the failure compiled again
    assert again[0] == {**first[0], "cached": True} and again[1]["error"] == "too big"
    assert AC.compile_all([ok], workers=1, cache=ResultCache(tmp_path, "code-b"))[0].get("cached") is None
    for stored in (tmp_path / "code-a").glob("*.json"):
        stored.write_text("{half")
    assert AC.compile_all([ok], workers=1, cache=cache)[0].get("cached") is None
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no temporaries left behind


def test_the_cache_key_follows_every_kernel_source_and_each_files_bytes(tmp_path, monkeypatch):
    from k2trt.runtime.aot import result_cache as aot_cache

    names = {p.relative_to(p.parents[1]).as_posix() for p in aot_cache.source_files()}
    assert {"kernels/fp8_linear.py", "kernels/moe.py", "kernels/moe_int4.py", "aot/ptx.py", "aot/moe.py",
            "aot/linear.py", "aot/moe_int4.py", "graphs/fp8.py", "aot/compile_one.py"} <= names
    assert "aot/sweep.py" not in names  # the table of launches: editing it changes no result
    kernel = tmp_path / "kernel.py"
    kernel.write_text("x = 1\n")
    monkeypatch.setattr(aot_cache, "source_files", lambda roots: [kernel])
    before = aot_cache.fingerprint()
    kernel.write_text("x = 2\n")
    edited = aot_cache.fingerprint()
    assert edited != before
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/other/ptxas")
    assert aot_cache.fingerprint() not in (before, edited)
