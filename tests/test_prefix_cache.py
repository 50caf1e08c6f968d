"""The paged latent cache and the prefix cache over real backends (torch, ONNX Runtime): a request's tokens with
its prefix reused, or after it was preempted and recomputed, are the tokens it gets alone with nothing cached —
greedy and seeded; the pool's bad sizes are one line at start, a request larger than the pool is a 400, and the
server reports what it reused (usage.prompt_tokens_details.cached_tokens, /metrics).

The scheduler's bookkeeping alone (random traffic, every invariant after every step) is tests/test_scheduler.py;
the pool's keys, reuse and eviction are tests/test_pages.py."""

from __future__ import annotations

import random

import pytest

from k2trt.checkpoint import Checkpoint
from k2trt.runtime.backends.factory import BackendChoice, open_backend
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler

PAGE = 8  # positions per page here: small, so short prompts span several pages
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11)


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes of several pages (one of them a page boundary exactly), and one sharing nothing."""
    rnd = random.Random(3)
    system = [rnd.randrange(vocab) for _ in range(5 * PAGE + 3)]
    return [system + [rnd.randrange(vocab) for _ in range(n)] for n in (6, 13, 1, 9)] + \
        [system[:3 * PAGE] + [rnd.randrange(vocab) for _ in range(4)], [rnd.randrange(vocab) for _ in range(20)]]


@pytest.fixture(scope="module", params=["torch", "ort"])
def executor(request, tiny_ckpt, tiny_export):
    ckpt = Checkpoint.open(tiny_ckpt)
    return StageExecutor(open_backend(BackendChoice(request.param, tiny_export), ckpt), ckpt.config)


def _run(executor, cases, limits: Limits, prefix_cache: bool, stagger: int = 0) -> tuple[list[list[int]], Scheduler]:
    """Each case (prompt, params, max new) submitted `stagger` iterations after the one before, run to the end."""
    sched = Scheduler(executor, executor.cfg, limits, prefix_cache=prefix_cache)
    reqs = []
    for prompt, params, max_new in cases:
        req = Request(list(prompt), max_new, params)
        sched.check(req)
        reqs.append(sched.submit(req))
        for _ in range(stagger):
            if sched.has_work():
                sched.iteration()
    sched.run_until_idle()
    assert all(r.done for r in reqs) and sched.pool.in_use == 0
    return [r.token_ids for r in reqs], sched


def _alone(executor, cases, limits: Limits) -> list[list[int]]:
    return [_run(executor, [case], limits, prefix_cache=False)[0][0] for case in cases]


@pytest.mark.slow
def test_a_reused_prefix_gives_the_tokens_computed_alone(executor):
    """Requests sharing prefixes, each arriving after the one before has written its pages: greedy and seeded,
    the tokens with the prefix cache on equal each request's alone with nothing cached, and the cache was hit."""
    limits = Limits(max_context=256, max_batch=4, prefill_chunk=64, page_tokens=PAGE)
    cases = [(p, params, 6) for p in _prompts(executor.cfg.vocab_size) for params in (GREEDY, SEEDED)]
    alone = _alone(executor, cases, limits)
    for stagger in (0, 3):
        got, sched = _run(executor, cases, limits, prefix_cache=True, stagger=stagger)
        assert got == alone, stagger
        counters = sched.cache_counters()
        assert counters.hit_tokens >= 3 * PAGE and counters.queried_tokens == sum(len(c[0]) for c in cases)
    off, sched = _run(executor, cases, limits, prefix_cache=False, stagger=3)
    assert off == alone and sched.cache_counters().hit_tokens == 0


def test_a_conversation_resent_each_turn_reuses_its_last_turn(executor):
    """An agent's turns: each prompt is the last prompt, its reply and a new message. Every turn after the first
    reuses all the full pages of the one before, and its tokens are those of the turn alone."""
    limits = Limits(max_context=256, max_batch=2, prefill_chunk=32, page_tokens=PAGE)
    rnd = random.Random(5)
    sched = Scheduler(executor, executor.cfg, limits)
    prompt = [rnd.randrange(executor.cfg.vocab_size) for _ in range(19)]
    for turn in range(4):
        req = Request(list(prompt), 5, SEEDED)
        sched.check(req)
        sched.submit(req)
        sched.run_until_idle()
        assert req.token_ids == _alone(executor, [(prompt, SEEDED, 5)], limits)[0], turn
        if turn:
            assert req.cached_tokens == (previous - 1) // PAGE * PAGE, turn  # noqa: F821 — set on turn 0
        previous = len(prompt) + len(req.token_ids) - 1  # the reply's last token was sampled, never cached
        prompt = prompt + req.token_ids + [rnd.randrange(executor.cfg.vocab_size) for _ in range(7)]


@pytest.mark.slow
def test_a_pool_too_small_preempts_and_every_request_keeps_its_tokens(executor):
    """Four slots over a pool of 12 pages of 8 positions, requests that grow to 6 pages each: the newest is
    preempted (parked when decoding, recomputed later), cached pages are evicted under load — never one a running
    sequence reads — and every request's tokens are its own alone."""
    limits = Limits(max_context=64, max_batch=4, prefill_chunk=16, cache_pages=12, page_tokens=PAGE)
    cases = [(p[:30], params, 14) for p in _prompts(executor.cfg.vocab_size) for params in (GREEDY, SEEDED)]
    alone = _alone(executor, cases, limits)
    got, sched = _run(executor, cases, limits, prefix_cache=True, stagger=1)
    assert got == alone
    assert sched.counters.preemptions > 0


def test_a_request_larger_than_the_pool_is_refused_before_any_work(executor):
    from k2trt.runtime.generation.limits import RequestError

    sched = Scheduler(executor, executor.cfg, Limits(max_context=128, max_batch=2, prefill_chunk=16, cache_pages=4,
                                                     page_tokens=PAGE))
    with pytest.raises(RequestError, match="needs 5 cache pages, more than the whole pool of 4"):
        sched.check(Request([1] * 30, 10))


def test_a_pool_without_a_page_per_slot_is_refused():
    from k2trt.errors import K2Error

    with pytest.raises(K2Error, match="at least 4"):
        Limits(max_context=64, max_batch=4, prefill_chunk=16, cache_pages=3)


# ---- the commands and the server ----------------------------------------------------------------------------

def test_cache_memory_below_a_page_per_slot_is_one_line_naming_the_size_that_works(tiny_ckpt, tiny_export, capsys):
    from k2trt.cli import main

    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "hi",
               "--cache-memory", "1KiB"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and "Traceback" not in err and len(lines) == 1, (rc, err)
    assert "--cache-memory 1,024 bytes holds 0 pages" in lines[0] and "need at least" in lines[0]


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "lots", "0%", "101%", "nan%"])
def test_a_cache_memory_that_is_not_a_size_is_one_line(tiny_ckpt, tiny_export, capsys, value):
    from fixtures import one_error_line

    from k2trt.cli import main

    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "hi",
               f"--cache-memory={value}"])
    assert "--cache-memory" in one_error_line(rc, capsys.readouterr().err, "generate")


def test_a_share_of_free_memory_sizes_the_pool_from_what_the_device_has_free(tiny_ckpt, tiny_export, monkeypatch):
    from k2trt.args import FreeShare
    from k2trt.errors import K2Error
    from k2trt.runtime.entrypoints import model
    from k2trt.runtime.cache import sizing
    from k2trt.runtime.cache.sizing import page_bytes

    loaded = model.LoadedModel(open_backend(BackendChoice("ort", tiny_export), Checkpoint.open(tiny_ckpt)), None,
                               Checkpoint.open(tiny_ckpt))
    size = page_bytes(loaded.config, loaded.backend.act_dtype)
    monkeypatch.setattr(sizing, "free_memory", lambda device: 1000 * size)
    assert loaded.limits(256, 4, cache_memory=FreeShare(0.5)).cache_pages == 500
    with pytest.raises(K2Error, match=f"--cache-memory 1% of {1000 * size:,} free bytes holds 10 pages"):
        loaded.limits(256, 16, cache_memory=FreeShare(0.01))


def test_the_server_reports_cached_tokens_and_refuses_a_request_larger_than_the_pool(tiny_ckpt, tiny_export):
    """A pool of 4 pages of 64 positions: a repeated long prompt answers usage.prompt_tokens_details.cached_tokens
    (and the same text), /metrics counts the hit, and a request needing more than the pool is a 400 at once."""
    import httpx
    from servers import InProcessServer, metric

    from k2trt.runtime.cache.pages import PAGE_TOKENS
    from k2trt.runtime.cache.sizing import page_bytes

    cfg = Checkpoint.open(tiny_ckpt).config
    size = page_bytes(cfg, open_backend(BackendChoice("ort", tiny_export), Checkpoint.open(tiny_ckpt)).act_dtype)
    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "2", "--cache-memory", str(4 * size)) as s:
        prompt = list(range(3, 3 + PAGE_TOKENS + 40))  # one full page and some
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
        again = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGE_TOKENS
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(s.url, "k2trt:prefix_cache_hits_total") == PAGE_TOKENS
        assert metric(s.url, "k2trt:prefix_cache_queries_total") == 2 * len(prompt)
        assert metric(s.url, "k2trt:cache_pages_total") == 4
        assert metric(s.url, "k2trt:cache_page_tokens") == PAGE_TOKENS
        assert metric(s.url, "k2trt:num_preemptions_total") == 0
        assert metric(s.url, "k2trt:prefix_cache_hit_ratio") == pytest.approx(PAGE_TOKENS / (2 * len(prompt)))
        assert metric(s.url, "k2trt:cache_positions_held") == 0
        assert metric(s.url, "k2trt:cache_pages_used") == 0  # nothing running: the cached page is free to evict

        r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": list(range(3, 3 + 3 * PAGE_TOKENS)),
                                                         "max_tokens": PAGE_TOKENS + 1}, timeout=120)
        assert r.status_code == 400, r.text
        assert "more than the whole pool of 4" in r.json()["error"]["message"]


def test_without_the_prefix_cache_the_server_reuses_nothing(tiny_ckpt, tiny_export):
    import httpx
    from servers import InProcessServer, metric

    with InProcessServer(tiny_ckpt, tiny_export, "--max-batch", "2", "--no-prefix-cache") as s:
        body = {"model": "tiny", "prompt": list(range(3, 200)), "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(s.url, "k2trt:prefix_cache_hits_total") == 0


@pytest.mark.slow
def test_pipeline_and_expert_parallel_stages_reuse_the_prefix_rank_0_found(tiny_ckpt, tiny_export, tiny_ep_exports):
    """`serve --pipeline 2 --expert-parallel 2`: prompts sharing a prefix of over two pages, sent one after the
    other, reuse it on every stage (cached_tokens > 0) and get the text one process computes alone, nothing
    cached."""
    import httpx
    from servers import Server

    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.text.text_stream import StopRules
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    ckpt, tok = Checkpoint.open(tiny_ckpt), KimiTokenizer.from_dir(tiny_ckpt)
    backend = open_backend(BackendChoice("ort", tiny_export), ckpt)
    limits = Limits(max_context=512, max_batch=4, prefill_chunk=512)
    ex = StageExecutor(backend, ckpt.config)
    gen = Generator(backend, ckpt.config, limits, ex, Scheduler(ex, ckpt.config, limits, prefix_cache=False))
    rnd = random.Random(9)
    system = [rnd.randrange(ckpt.config.vocab_size) for _ in range(150)]
    cases = [(system + [rnd.randrange(ckpt.config.vocab_size) for _ in range(n)], params, 6)
             for n in (5, 11, 2) for params in (GREEDY, SEEDED)]
    alone = [gen.generate([p], n, params, StopRules.of(tok))[0][0].text for p, params, n in cases]
    s = Server(tiny_ckpt, tiny_ep_exports[2], "--pipeline", "2", "--expert-parallel", "2", "--max-context", "512",
               "--dist-timeout", "60")
    try:
        cached = []
        for (prompt, params, max_new), want in zip(cases, alone):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_new, "temperature": params.temperature,
                    "top_p": params.top_p, "seed": params.seed}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
            cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert r["choices"][0]["text"] == want, (prompt[-3:], params)
        assert cached[0] == 0 and all(c >= 128 for c in cached[1:]), cached
    finally:
        assert s.stop() == 0, s.output()


def test_generate_reports_the_prompt_tokens_it_reused(tiny_ckpt, tiny_export, capsys):
    """`generate --json` names each result's cached prompt tokens; one generator asked twice (as chat's turns
    are) reuses the first prompt's full pages the second time, and the tokens do not change."""
    import json

    from k2trt.cli import main
    from k2trt.runtime.generation.generator import Generator

    assert main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--json",
                 "--max-new-tokens", "2", "--prompt", "word " * 150]) == 0
    assert json.loads(capsys.readouterr().out)["cached_tokens"] == 0
    ckpt = Checkpoint.open(tiny_ckpt)
    gen = Generator(open_backend(BackendChoice("ort", tiny_export), ckpt), ckpt.config)
    prompt = list(range(3, 3 + 150))
    [first], _ = gen.generate([prompt], 4)
    [again], _ = gen.generate([prompt], 4)
    assert first.cached_tokens == 0 and again.cached_tokens == (len(prompt) - 1) // 64 * 64 == 128
    assert again.token_ids == first.token_ids


def test_on_a_gpu_the_pool_defaults_to_a_share_of_free_memory(tiny_ckpt, monkeypatch):
    """No --cache-memory on a CUDA backend: 90 % of what is free once the model has loaded, at most what every slot
    at the context needs; on the CPU the latter alone. (The device is only named here: nothing is allocated.)"""
    import torch

    from k2trt.errors import K2Error
    from k2trt.runtime.backends.contract import BackendLimits
    from k2trt.runtime.entrypoints import model
    from k2trt.runtime.cache import sizing
    from k2trt.runtime.cache.pages import PAGE_TOKENS
    from k2trt.runtime.cache.sizing import page_bytes

    class Named:
        limits, act_dtype = BackendLimits(), torch.float32

        def __init__(self, device):
            self.device = torch.device(device)

    ckpt = Checkpoint.open(tiny_ckpt)
    size = page_bytes(ckpt.config, torch.float32, PAGE_TOKENS)
    every_slot = model.LoadedModel(Named("cpu"), None, ckpt).limits(max_context=1024, max_batch=4).cache_pages
    assert every_slot == 4 * 1024 // PAGE_TOKENS
    gpu = model.LoadedModel(Named("cuda"), None, ckpt)
    monkeypatch.setattr(sizing, "free_memory", lambda device: 40 * size)
    assert gpu.limits(max_context=1024, max_batch=4).cache_pages == 36  # 90 % of 40 pages
    monkeypatch.setattr(sizing, "free_memory", lambda device: 10_000 * size)
    assert gpu.limits(max_context=1024, max_batch=4).cache_pages == every_slot
    assert gpu.limits(max_context=1024, max_batch=4, cache_memory=8 * size).cache_pages == 8  # asked: as asked
    monkeypatch.setattr(sizing, "free_memory", lambda device: 3 * size)
    with pytest.raises(K2Error, match=r"\(by default\) 90% of .* free bytes holds 2 pages"):
        gpu.limits(max_context=1024, max_batch=4)


def test_a_gpu_stage_reserves_the_whole_pool_at_its_first_step(executor):
    """Every plan names the pool's size: a CUDA stage (reserve_whole, set from its device; forced here on the CPU)
    reserves all of it at once and never grows, a CPU stage grows to the highest page named. Tokens are the same."""
    limits = Limits(max_context=128, max_batch=2, prefill_chunk=32, cache_pages=20, page_tokens=PAGE)
    case = [(list(range(3, 40)), GREEDY, 6)]
    cpu_stage = StageExecutor(executor.backend, executor.cfg)
    assert cpu_stage.reserve_whole is False  # a CPU backend
    grown, _ = _run(cpu_stage, case, limits, prefix_cache=False)
    assert cpu_stage.cache.pages < 20
    whole_stage = StageExecutor(executor.backend, executor.cfg)
    whole_stage.reserve_whole = True
    sizes = []
    run = whole_stage.run
    whole_stage.run = lambda plan: (run(plan), sizes.append(whole_stage.cache.pages))[0]
    whole, _ = _run(whole_stage, case, limits, prefix_cache=False)
    assert whole == grown and set(sizes) == {20}
