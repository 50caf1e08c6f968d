"""Many devices on a CPU: the placement planner at K2 size, and pipeline stages and expert-parallel ranks as real
processes over gloo.

Greedy and seeded tokens of a ragged batch (with an early stop token and a stop string) must equal the single
process's at world sizes 1, 2 and 3, at EP 2 and 4, PP 2 × EP 2 and PP 2 with 2 micro-batches in flight, and under a
router that sends every token to one rank's experts; a rank that fails, or is killed mid-step, ends every rank with
one line; torchrun runs the same command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.distributed import placement

K2TRT = [sys.executable, "-m", "k2trt.cli"]
PROMPTS = ["The quick brown fox jumps over", "Hello",
           "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich."]


# ---- placement --------------------------------------------------------------------------------------------

def k2_items(max_context=4096, max_batch=1):
    cfg = K2Config.preset("kimi-k2")
    return placement.items_from_config(cfg, placement.cache_bytes_per_layer(cfg, max_context, max_batch))


def test_k2_on_8_h200_is_the_notes_plan():
    plan = placement.place_stages(k2_items(), 8, placement.parse_size("140GiB"))
    assert plan.fits
    assert [s.describe() for s in plan.stages] == [
        "embedding + 0–7", "8–15", "16–23", "24–31", "32–39", "40–46", "47–53", "54–60 + head"]
    assert plan.counts() == [8, 8, 8, 8, 8, 7, 7, 7]
    assert 136e9 < plan.heaviest.bytes < 137e9  # 8 MoE blocks


def test_k2_on_16_h100_is_twelve_stages_of_four_moe_blocks_and_four_of_three():
    plan = placement.place_stages(k2_items(), 16, placement.parse_size("79.6GiB"))
    cfg = K2Config.preset("kimi-k2")
    moe = [sum(cfg.is_moe_layer(i) for i in s.layers) for s in plan.stages]
    assert plan.fits and sorted(moe) == [3] * 4 + [4] * 12
    assert plan.stages[0].first and plan.stages[-1].last and 68e9 < plan.heaviest.bytes < 69e9


def test_k2_on_4_h200_is_refused_with_the_smallest_count_that_fits(capsys):
    from k2trt.cli import main

    assert not placement.place_stages(k2_items(), 4, placement.parse_size("140GiB")).fits
    from k2trt.runtime.distributed.layout import smallest_pipeline

    assert smallest_pipeline(K2Config.preset("kimi-k2"), k2_items(), 1, placement.parse_size("140GiB"),
                             placement.DEFAULT_RESERVE, 4096, 1, start=5) == 8
    rc = main(["plan", "--preset", "kimi-k2", "--devices", "4", "--device-memory", "140GiB"])
    cap = capsys.readouterr()
    assert rc == 2 and "embedding + 0–15" in cap.out
    assert cap.err.strip().splitlines() == [cap.err.strip()] and "the smallest device count that fits is 8" in cap.err


def test_explicit_split_is_validated_the_same_way(capsys):
    from k2trt.cli import main

    plan = placement.place_stages(k2_items(), 8, placement.parse_size("140GiB"), counts=[8, 8, 8, 8, 8, 7, 7, 7])
    assert plan.fits and plan.counts() == [8, 8, 8, 8, 8, 7, 7, 7]
    assert not placement.place_stages(k2_items(), 8, placement.parse_size("140GiB"), counts=[10, 8, 8, 8, 7, 7, 7, 6]).fits
    with pytest.raises(K2Error, match="adding up to 61"):
        placement.place_stages(k2_items(), 8, placement.parse_size("140GiB"), counts=[8] * 8)
    with pytest.raises(K2Error, match="gives 2 stages for 8 devices"):
        placement.place_stages(k2_items(), 8, placement.parse_size("140GiB"), counts=[30, 31])
    rc = main(["plan", "--preset", "kimi-k2", "--devices", "8", "--device-memory", "140GiB",
               "--stages", "10,8,8,8,7,7,7,6", "--json"])
    cap = capsys.readouterr()
    assert rc == 2 and json.loads(cap.out)["fits"] is False and "the smallest device count that fits is 8" in cap.err


def test_plan_counts_the_cache_for_the_requested_context_and_batch():
    small, big = k2_items(4096, 1), k2_items(131072, 8)
    cfg = K2Config.preset("kimi-k2")
    assert big[5].cache_bytes == 131072 * 8 * cfg.latent_dim * 2 and small[5].cache_bytes * 256 == big[5].cache_bytes
    assert not placement.place_stages(big, 8, placement.parse_size("140GiB")).fits  # 8 layers x 1.2 GB of cache tips it over


@pytest.mark.parametrize("text, value", [("140GiB", 140 * 2**30), ("80GB", 80 * 10**9), ("1.5 TB", 15 * 10**11),
                                         ("512", 512), ("79.6GiB", int(79.6 * 2**30))])
def test_sizes_with_units(text, value):
    assert placement.parse_size(text) == value


def test_a_size_without_a_known_unit_is_one_clear_line():
    with pytest.raises(K2Error, match="is not a size"):
        placement.parse_size("140 gigs")


def test_plan_from_a_checkpoint_reads_its_headers(tiny_ckpt, capsys):
    from k2trt.cli import main

    rc = main(["plan", "--model", str(tiny_ckpt), "--devices", "2", "--device-memory", "1GB", "--reserve", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [s["layers"] for s in out["stages"]] in ([[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0], [1, 2, 3]])
    from safetensors import safe_open

    total = 0  # every tensor's bytes, as the official reader sees the files
    for shard in Path(tiny_ckpt).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                n = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[t.get_dtype()]
                for d in t.get_shape():
                    n *= d
                total += n
    assert sum(s["weight_bytes"] for s in out["stages"]) == total


# ---- pipeline runs ----------------------------------------------------------------------------------------

def generate(tiny_ckpt, tiny_export, extra, timeout=240):
    args = ["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--max-new-tokens", "12", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    r = subprocess.run(K2TRT + args + extra, capture_output=True, text=True, timeout=timeout)
    return r


def generate_here(tiny_ckpt, tiny_export, extra):
    """`generate` in this process, through the CLI's own entry point: the one-process runs the pipelines must
    reproduce cross no process boundary, so they need no interpreter of their own."""
    import contextlib
    import io

    from k2trt.cli import main

    args = ["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--max-new-tokens", "12", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args + extra)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def results(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return [(x["token_ids"], x["finish_reason"]) for x in json.loads(r.stdout)["results"]]


@pytest.fixture(scope="module")
def single(tiny_ckpt, tiny_export):
    """The single-process runs every pipeline run must reproduce, and the stop rules that make them ragged."""
    free = results(generate_here(tiny_ckpt, tiny_export, []))
    stop_id = free[1][0][4]  # prompt 1 stops early, at its fifth token
    stop_text = None
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(tiny_ckpt)
    text = tok.decode(free[2][0][:8])
    stop_text = text[len(text) // 2:][:2] if text.strip() else None
    rules = ["--stop-token-id", str(stop_id)] + (["--stop", stop_text] if stop_text else [])
    greedy = results(generate_here(tiny_ckpt, tiny_export, rules))
    seeded = results(generate_here(tiny_ckpt, tiny_export, rules + ["--temperature", "0.9", "--top-p", "0.95",
                                                                    "--seed", "7"]))
    assert greedy[1][1] == "stop_token" and len(greedy[1][0]) <= 5
    return rules, greedy, seeded


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_pipeline_tokens_equal_the_single_process(tiny_ckpt, tiny_export, single, world):
    rules, greedy, seeded = single
    assert results(generate(tiny_ckpt, tiny_export, rules + ["--pipeline", str(world)])) == greedy
    if world == 2:
        sampled = rules + ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7", "--pipeline", "2"]
        assert results(generate(tiny_ckpt, tiny_export, sampled)) == seeded


SAMPLED = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["--expert-parallel 2", "--expert-parallel 4", "--pipeline 2 --expert-parallel 2",
                                    "--pipeline 2 --micro-batches 2"])
def test_expert_parallel_and_micro_batches_give_the_single_process_tokens(tiny_ckpt, tiny_export, tiny_ep_exports,
                                                                          single, layout):
    """Three ragged sequences with early stops: at EP 4 one rank holds none of them and serves its experts; with
    2 micro-batches in flight the lanes hold two and one."""
    rules, greedy, seeded = single
    flags = layout.split()
    e = int(flags[flags.index("--expert-parallel") + 1]) if "--expert-parallel" in flags else 1
    onnx = tiny_ep_exports[e] if e > 1 else tiny_export
    assert results(generate(tiny_ckpt, onnx, rules + flags + ["--dist-timeout", "60"])) == greedy
    assert results(generate(tiny_ckpt, onnx, rules + SAMPLED + flags + ["--dist-timeout", "60"])) == seeded


@pytest.mark.slow
def test_a_router_choosing_one_ranks_experts_gives_the_single_process_tokens(tiny_ckpt, tiny_ep_exports, tmp_path):
    """Every token's every expert on rank 0 (a correction bias in a copy of the checkpoint): rank 1 computes no
    expert, rank 0 all of them, and the tokens are still one process's."""
    from test_expert_parallel import one_rank_router

    biased = one_rank_router(tiny_ckpt, tmp_path / "biased")
    alone = results(generate_here(biased, tiny_ep_exports[2], []))
    assert results(generate(biased, tiny_ep_exports[2], ["--expert-parallel", "2", "--dist-timeout", "60"])) == alone


@pytest.mark.slow
def test_an_explicit_stage_split_gives_the_same_tokens(tiny_ckpt, tiny_export, single):
    rules, greedy, _ = single
    assert results(generate(tiny_ckpt, tiny_export, rules + ["--pipeline", "2", "--stages", "3,1"])) == greedy
    r = generate(tiny_ckpt, tiny_export, ["--pipeline", "2", "--stages", "3,3"])
    assert r.returncode == 2 and r.stderr.strip().endswith("must be positive block counts adding up to 4 "
                                                           "(the model's blocks)")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_failing_rank_ends_every_rank_with_one_line(tiny_ckpt, tiny_export, tmp_path):
    """A shard only rank 1 reads is truncated: rank 1 fails while binding its layers, and every rank ends."""
    from fixtures import clone

    index = json.loads((Path(tiny_ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = K2Config.from_json(tiny_ckpt)
    from k2trt.runtime.distributed.session import stage_split

    rank1 = set(stage_split(cfg, 2, None).stages[1].layers)

    def owner(name):
        return int(name.split(".")[2]) if name.startswith("model.layers.") else (0 if "embed" in name else "head")

    shards = {}
    for name, shard in index.items():
        shards.setdefault(shard, set()).add(owner(name))
    only_rank1 = sorted(s for s, owners in shards.items() if owners <= rank1 | {"head"})
    assert only_rank1, shards
    bad = clone(Path(tiny_ckpt), tmp_path / "ckpt", copy=(only_rank1[0],))
    path = bad / only_rank1[0]
    path.write_bytes(path.read_bytes()[:-1000])
    t0 = time.monotonic()
    r = subprocess.run(K2TRT + ["generate", "--model", str(bad), "--onnx", str(tiny_export), "--prompt", "Hi",
                                "--pipeline", "2", "--dist-timeout", "20"], capture_output=True, text=True, timeout=180)
    assert time.monotonic() - t0 < 120
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith("k2trt generate: error: rank 1: ") and only_rank1[0] in err[0], err


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The pid of the launcher's child with RANK=rank, if it is there yet."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def killed_mid_step(ckpt, onnx, flags: list[str], victim: int) -> tuple[int, list[str], float]:
    """Generate thousands of tokens over ranks, SIGKILL rank `victim` once rank 0 has streamed its first text
    (loaded and stepping): -> (exit status, stderr lines, seconds to the end)."""
    import signal

    from servers import HANG_S, wait_until

    args = ["generate", "--model", str(ckpt), "--onnx", str(onnx), "--prompt", "Hi", "--max-new-tokens", "5000",
            "--max-context", "8000", "--dist-timeout", "20", *flags]
    t0 = time.monotonic()
    proc = subprocess.Popen(K2TRT + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = wait_until(lambda: _child_with_rank(proc.pid, victim), f"rank {victim} to start", every_s=0.1)
        assert proc.stdout.read(1), "rank 0 streamed nothing"  # the first character of the generated text
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err.strip().splitlines(), time.monotonic() - t0


@pytest.mark.slow
def test_a_killed_rank_ends_every_rank(tiny_ckpt, tiny_export):
    """A rank that dies without a word (SIGKILL) while the pipeline steps still ends the run, naming it, within
    the timeout."""
    code, lines, _ = killed_mid_step(tiny_ckpt, tiny_export, ["--pipeline", "2"], 1)
    assert code == 2 and lines[-1].startswith("k2trt generate: error: rank 1 "), lines
    assert "signal 9" in lines[-1] or "lost contact" in lines[-1] or "rank 1 failed" in lines[-1]


@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_every_expert_parallel_rank(tiny_ckpt, tiny_ep_exports):
    """PP 2 × EP 2: an expert-parallel rank of the last stage, SIGKILLed while the ranks step, ends the run in one
    line within the timeout: its stage partner loses it in an all-to-all, rank 0 waiting for ids, the launcher
    names it."""
    from servers import HANG_S

    code, lines, seconds = killed_mid_step(tiny_ckpt, tiny_ep_exports[2], ["--pipeline", "2", "--expert-parallel",
                                                                          "2"], 3)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("k2trt generate: error: rank 3 ") and "signal 9" in lines[0], lines
    assert seconds < HANG_S


@pytest.mark.slow
def test_torchrun_runs_the_same_command(tiny_ckpt, tiny_export, single):
    rules, greedy, _ = single
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun ships with torch"
    args = ["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--max-new-tokens", "12", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "k2trt.cli", *args, *rules],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # torchrun merges the ranks' output: only rank 0 printed anything
    assert [(x["token_ids"], x["finish_reason"]) for x in json.loads(r.stdout.strip().splitlines()[-1])["results"]] \
        == greedy


def bench(tiny_ckpt, onnx, *flags):
    r = subprocess.run(K2TRT + ["bench", "--model", str(tiny_ckpt), "--onnx", str(onnx), "--batch", "2",
                                "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1", "--json", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_reports_the_pipeline_against_one_process(tiny_ckpt, tiny_export):
    out = bench(tiny_ckpt, tiny_export, "--pipeline", "2", "--micro-batches", "1,2")
    single, piped = out["single_process"], out["pipeline"]
    assert single["ms_per_decode_step"] > 0 and piped["ms_per_decode_step"] > 0 and piped["stages"] == 2
    # the share is the one-micro-batch run's own (rank timings marked between runs), over the same step windows
    # on every rank: rank 0's transfers are timed inside its step windows (StageRunner.timing), so the share is
    # below 1 by construction at any speed (the whole session's counters, read once, had passed it on one core)
    assert 0 <= piped["transfer_share"] < 1 and piped == {**out["runs"][0], "stages": 2}
    assert [run["micro_batches"] for run in out["runs"]] == [1, 2] and all(
        run["decode_tokens_per_s"] > 0 for run in out["runs"])
    assert out["runs"][1]["transfer_share"] is None  # overlapped lanes: no waits to tell from work


@pytest.mark.slow
def test_bench_reports_the_all_to_all_of_expert_parallel_ranks(tiny_ckpt, tiny_ep_exports):
    out = bench(tiny_ckpt, tiny_ep_exports[2], "--expert-parallel", "2")
    piped, cfg = out["pipeline"], K2Config.from_json(tiny_ckpt)
    assert out["expert_parallel"] == 2 and out["stages"] == 1 and out["single_process"]["ms_per_decode_step"] > 0
    assert 0 < piped["all_to_all_share"] < 1
    # a decode step of two sequences: each rank sends the other its pairs for the other's experts and gets their
    # outputs back, at most 2 × k rows of d float32 each way per MoE layer (and the counts)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    most = moe_layers * 2 * (2 * cfg.num_experts_per_tok * cfg.hidden_size * 4 + cfg.n_routed_experts * 8)
    assert 0 < piped["bytes_per_decode_step"] <= most


@pytest.mark.slow
def test_serve_over_expert_parallel_ranks_and_micro_batches(tiny_ckpt, tiny_export, tiny_ep_exports):
    """`serve --pipeline 2 --expert-parallel 2 --micro-batches 2`, behind a key (rank 0 checks it: the official
    client sends its api_key "none" as the bearer token): requests arriving together, greedy and seeded, get the
    text one process generates for each alone."""
    import concurrent.futures as cf

    import httpx
    from servers import Server

    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.sampling import SamplingParams
    from k2trt.runtime.text.text_stream import StopRules
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    ckpt, tok = Checkpoint.open(tiny_ckpt), KimiTokenizer.from_dir(tiny_ckpt)
    gen = Generator(open_backend(BackendChoice("ort", tiny_export), ckpt), ckpt.config)
    cases = [(p, SamplingParams(temperature=t, top_p=tp, seed=s)) for p in PROMPTS
             for t, tp, s in ((0.0, 1.0, 0), (0.9, 0.95, 7))]
    alone = [gen.generate([tok.encode(p)], 10, params, StopRules.of(tok))[0][0].text for p, params in cases]
    s = Server(tiny_ckpt, tiny_ep_exports[2], "--pipeline", "2", "--expert-parallel", "2", "--micro-batches", "2",
               "--max-context", "512", "--dist-timeout", "60", "--api-key", "none")
    try:
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401

        def ask(case):
            prompt, params = case
            r = s.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=params.temperature,
                                            top_p=params.top_p, seed=params.seed)
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(cases)) as pool:
            assert list(pool.map(ask, cases)) == alone
    finally:
        assert s.stop() == 0, s.output()


def _exchange_messages(rank: int, port: int, sizes: list[int], out) -> None:
    """Rank 0 sends messages of these sizes to rank 1, which posts each receive before reading the last."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from k2trt.runtime.distributed.pipeline import Transport
    from k2trt.runtime.distributed.world import World

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, as the launcher sets it
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    world = World(rank, 2, rank, store, dist.group.WORLD, dist.group.WORLD, 60.0)
    tr = Transport(world, torch.device("cpu"))
    blobs = [bytes((i * 7 + n) % 256 for i in range(n)) for n in sizes]
    if rank == 0:
        for blob in blobs:
            tr.send_message(1, blob)
        tr.flush()
    else:
        posted = tr.expect_message(0)
        got = []
        for _ in blobs:
            blob = tr.message(posted, 0)
            posted = tr.expect_message(0) if len(got) + 1 < len(blobs) else None
            got.append(blob)
        out.put(got == blobs)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_messages_of_any_length_arrive_whole():
    """A step's message is one frame of FRAME bytes, and past it a second part: lengths around the frame's edge
    and far past it arrive whole and in order."""
    import multiprocessing

    from k2trt.runtime.distributed.pipeline import FRAME
    from k2trt.tools.bench_serve import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    sizes = [0, 5, FRAME - 8, FRAME - 7, FRAME, 5 * FRAME + 3, 17]
    port = free_port()
    procs = [ctx.Process(target=_exchange_messages, args=(r, port, sizes, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=120) is True
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
