"""Speculative decoding by prompt lookup (runtime/generation/speculation.py): the proposal, the config, and
exactness — the tokens with speculation are the tokens without it, greedy and seeded, through the real executor
and scheduler, with stops, token budgets, small pools (preemption), prefix hits and log-probabilities."""

from __future__ import annotations

import json
import random

import pytest
import torch

from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.generator import Generator
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.generation.sampling import SamplingParams
from k2trt.runtime.generation.scheduler import Request, Scheduler
from k2trt.runtime.generation.speculation import (DraftBackoff, DraftLength, SpecCounters, SpeculativeConfig,
                                                  SpeedPolicy, ngram_proposal)
from k2trt.runtime.text.text_stream import StopRules

TINY = K2Config.preset("tiny")
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


# ---- the proposal ---------------------------------------------------------------------------------------------

def test_the_longest_suffix_proposes_what_followed_its_latest_occurrence():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_proposal(seq, 2, 1, 3) == [7, 8]  # "2 3" last seen before 7 8 (the latest of two)
    assert ngram_proposal(seq, 9, 1, 3) == [7, 8, 5, 2, 3]  # at most what follows
    assert ngram_proposal(seq + [4], 3, 1, 3) == []  # 4 never seen before
    assert ngram_proposal([5, 6, 5], 2, 1, 3) == [6, 5]
    assert ngram_proposal([5, 6, 5], 2, 2, 3) == []  # no 2-gram repeats
    assert ngram_proposal([5], 2, 1, 3) == [] and ngram_proposal(seq, 0, 1, 3) == []


def test_a_request_that_stops_agreeing_backs_off_and_comes_back_when_it_agrees():
    b = DraftBackoff()
    b.verified(0)
    assert [b.ready() for _ in range(2)] == [False, True]
    b.verified(0)
    assert [b.ready() for _ in range(3)] == [False, False, True]
    b.verified(2)
    assert b.ready() and b.misses == 0


def test_draft_positions_seldom_kept_stop_being_proposed_and_are_probed_again():
    """A draft kept only at its first position: k shrinks to 1 (each later position widened every verify row for
    nothing) and is tried whole every PROBE_STEPS steps, so a draft that starts agreeing gets its k back."""
    dl = DraftLength()
    assert dl.k(3) == 3  # nothing measured: the configured k
    for _ in range(40):
        dl.observe(3, 1)
    ks = [dl.k(3) for _ in range(2 * DraftLength.PROBE_STEPS)]
    assert ks.count(3) == 2 and set(ks) == {1, 3}
    for _ in range(40):
        dl.observe(3, 3)
    assert dl.k(3) == 3 and dl.k(5) == 5  # kept again; positions never measured count as kept


def test_speculation_pauses_where_it_is_slower_and_tries_again():
    p = SpeedPolicy()
    assert [p.allow() for _ in range(SpeedPolicy.WARMUP)] == [False] * SpeedPolicy.WARMUP  # the plain rate first
    for _ in range(3):
        p.observe(0.01, 8, speculated=False)  # 800 tok/s without drafts
    assert p.allow()
    p.observe(0.02, 12, speculated=True)  # 600 tok/s with them: it pauses
    assert [p.allow() for _ in range(SpeedPolicy.PAUSE_STEPS)] == [False] * SpeedPolicy.PAUSE_STEPS
    assert p.allow()  # and tries again
    for _ in range(6):
        p.observe(0.01, 20, speculated=True)  # 2000 tok/s: the average climbs past the plain rate
    assert p.spec_rate > p.plain_rate and p.allow() and p.pause == 0


@pytest.mark.parametrize("text, says", [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "ngram", "model": "x"}', '"model" (the draft) goes with method eagle3'),
    ('{"method": "eagle3"}', '"model" (the draft) goes with method eagle3'),
    ('{"method": "medusa"}', "method 'medusa' is not supported"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be 1..16"),
    ('{"num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
])
def test_a_bad_speculative_config_is_one_line(text, says, tiny_ckpt, tiny_export, capsys):
    from k2trt.cli import main

    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "hi",
               "--speculative-config", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--speculative-config" in err[0] and says in err[0], err


# ---- a model whose next token is a function of the current one ------------------------------------------------

class Table:
    """A backend with no layers: the hidden state is the token id, and the head's logits are a row of `table` —
    so text repeats and prompt lookup has something to find, and every path of the real executor runs."""
    name, device, act_dtype = "table", torch.device("cpu"), torch.float32

    def __init__(self, table: torch.Tensor):
        self.table = table

    def embed(self, ids):
        return ids.unsqueeze(-1).float()

    def head(self, hidden):
        return self.table[hidden[..., 0].long()].clone()

    def session_seconds(self):
        return None


def cyclic(vocab: int = TINY.vocab_size, period: int = 13) -> torch.Tensor:
    """Greedy walks a cycle of `period` tokens: after one lap, every draft agrees."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    nxt = (torch.arange(vocab) * 5 + 1) % period
    table[torch.arange(vocab), nxt] += 100.0
    return table


def narrow(vocab: int = TINY.vocab_size, width: int = 12) -> torch.Tensor:
    """Random logits over the first `width` tokens only: sampled text repeats often, drafts sometimes agree."""
    table = torch.full((vocab, vocab), -1e4)
    table[:, :width] = 2 * torch.randn(vocab, width, generator=torch.Generator().manual_seed(1))
    return table


class Always:
    """A speed policy that always lets requests propose: what the counters below count does not depend on how
    fast this machine runs the steps (the measured policy is tested on its own)."""

    def allow(self):
        return True

    def observe(self, seconds, tokens, speculated):
        pass


def run(table, cases, spec, limits=None, stagger=0):
    """Each case (prompt, params, max_new, stops) through one scheduler; -> (requests, scheduler)."""
    limits = limits or Limits(max_context=512, max_batch=4, prefill_chunk=64)
    ex = StageExecutor(Table(table), TINY, layers=[])
    sched = Scheduler(ex, TINY, limits, speculation=spec)
    sched.spec_policy = Always()
    reqs = []
    for prompt, params, max_new, stops in cases:
        reqs.append(sched.submit(Request(list(prompt), max_new, params, StopRules(ids=frozenset(stops)))))
        for _ in range(stagger):
            sched.iteration()
    sched.run_until_idle()
    return reqs, sched


def test_a_draft_that_always_agrees_keeps_every_token_and_changes_none():
    cases = [([3, 4], SamplingParams(), 60, ())]
    plain, _ = run(cyclic(), cases, None)
    fast, sched = run(cyclic(), cases, NGRAM)
    assert fast[0].token_ids == plain[0].token_ids and len(plain[0].token_ids) == 60
    c = sched.spec_counters
    assert c.mean_accepted_length > 4 and c.accepted_per_pos[0] >= c.accepted_per_pos[-1] > 0
    assert sched.timings.decode_steps < 25 and sched.timings.decode_tokens == 59  # the first came from prefill


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of counts against expected counts, cells with an expected count under 5 merged into one;
    -> its p-value (the chi-square survival function: torch's regularized upper incomplete gamma)."""
    small = expected < 5
    o = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    e = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    o, e = o[e > 0], e[e > 0]
    chi2 = float(((o - e) ** 2 / e).sum())
    df = o.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_sampled_tokens_with_drafts_follow_the_targets_joint():
    """Temperature 1, 20,000 seeded requests after one prompt: the first token comes from the prefill, the second
    from a verify step whose draft (prompt lookup: the prompt holds every token, so one is always proposed) is kept
    only where the request's own draw equals it. The joint frequency of the two tokens against the exact
    p(t1)·p(t2 | t1) of the target's table: chi-square, p > 0.001 — and the same test fails for a wrong joint (the
    second token drawn at temperature 0.5), so it can tell."""
    table = narrow()
    width = 12
    prompt = list(range(width)) * 2
    n = 20_000
    # seeds of their own (another 20,000 give p = 0.8 and 0.7; the first 20,000 0.008, with and without drafts)
    cases = [(prompt, SamplingParams(temperature=1.0, seed=100_000 + i), 3, ()) for i in range(n)]  # room: 1 draft
    limits = Limits(max_context=64, max_batch=256, prefill_chunk=64)
    reqs, sched = run(table, cases, NGRAM, limits)
    assert sched.spec_counters.num_drafts == n  # every second token went through a verify step with a draft
    assert 0 < sched.spec_counters.num_accepted_tokens < n
    plain, _ = run(table, cases, None, limits)
    assert [r.token_ids for r in reqs] == [r.token_ids for r in plain]  # and they are the draws of no speculation
    counts = torch.zeros(width, width, dtype=torch.float64)
    for r in reqs:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    p1 = torch.softmax(table[prompt[-1], :width].double(), dim=-1)
    joint = p1[:, None] * torch.softmax(table[:width, :width].double(), dim=-1)
    assert _chi_square_p(counts.flatten(), n * joint.flatten()) > 1e-3
    wrong = p1[:, None] * torch.softmax(table[:width, :width].double() / 0.5, dim=-1)
    assert _chi_square_p(counts.flatten(), n * wrong.flatten()) < 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_mixed_batches_greedy_and_seeded_with_stops_and_budgets_get_the_tokens_of_no_speculation(seed):
    rnd = random.Random(seed)
    table = narrow() if seed % 2 else cyclic()
    cases = []
    for i in range(6):
        prompt = [rnd.randrange(12) for _ in range(rnd.randint(1, 20))]
        params = SamplingParams() if i % 2 else SamplingParams(temperature=1.0, top_p=0.9, seed=rnd.randrange(99),
                                                                logprobs=2)
        stops = {rnd.randrange(12)} if i % 3 == 0 else set()
        cases.append((prompt, params, rnd.randint(1, 40), stops))
    limits = Limits(max_context=128, max_batch=3, prefill_chunk=8)
    plain, _ = run(table, cases, None, limits, stagger=1)
    fast, sched = run(table, cases, NGRAM, limits, stagger=1)
    for p, f in zip(plain, fast):
        assert f.token_ids == p.token_ids and f.finish_reason == p.finish_reason
        assert [(e.token, round(e.logprob, 5)) for e in f.logprobs] == [(e.token, round(e.logprob, 5))
                                                                        for e in p.logprobs]
    assert sched.spec_counters.num_accepted_tokens > 0


def test_a_small_pool_preempts_and_reuses_prefixes_with_the_same_tokens():
    """Pages for the drafts are taken only where free (a draft never preempts); the pool is small enough that
    decoding requests are preempted and prefixes are reused."""
    rnd = random.Random(7)
    shared = [rnd.randrange(12) for _ in range(9)]
    cases = [(shared + [rnd.randrange(12) for _ in range(rnd.randint(1, 6))],
              SamplingParams(temperature=0.8, seed=i), 30, ()) for i in range(6)]
    limits = Limits(max_context=64, max_batch=3, prefill_chunk=8, cache_pages=12, page_tokens=4)
    plain, _ = run(narrow(), cases, None, limits, stagger=2)
    fast, sched = run(narrow(), cases, NGRAM, limits, stagger=2)
    assert [f.token_ids for f in fast] == [p.token_ids for p in plain]
    assert sched.counters.preemptions > 0 and sched.counters.hit_tokens > 0
    assert sched.spec_counters.num_accepted_tokens > 0


def test_speculation_needs_an_executor_that_verifies():
    class Lane:
        samples_here = verifies_drafts = False

    with pytest.raises(K2Error, match="cannot verify drafts"):
        Scheduler(Lane(), TINY, Limits(max_context=64, max_batch=1, prefill_chunk=8), speculation=NGRAM)


# ---- the tiny model: text, stop strings, the CLI ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend_name, new_tokens", [("ort", 80), ("torch", 24)])
def test_the_tiny_model_gives_the_same_text_and_stops_mid_draft(tiny_ckpt, tiny_export, backend_name, new_tokens):
    """ONNX Runtime and the torch reference, greedy and seeded, a stop string cut from the plain run's own text (so
    it lands inside a verify step's tokens where drafts agree), the same text and finish with and without prompt
    lookup; the speed policy is set to always propose, so drafts are verified whatever this machine's speed."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.backends.factory import BackendChoice, open_backend
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    ckpt, tok = Checkpoint.open(tiny_ckpt), KimiTokenizer.from_dir(tiny_ckpt)
    backend = open_backend(BackendChoice(backend_name, tiny_export), ckpt)
    limits = Limits(max_context=2048, max_batch=4, prefill_chunk=512)
    # half the vocabulary's ids, then a phrase: much of what the model writes was seen, so drafts are found
    prompt = list(range(3, 1000)) + tok.encode(" one two three one two three")

    # one scheduler for every run, speculating or not: after the first, each run reuses the prompt's cached pages
    # (prefix hits under speculation too), so the long prompt is computed once
    ex = StageExecutor(backend, ckpt.config)
    sched = Scheduler(ex, ckpt.config, limits)
    sched.spec_policy = Always()
    g = Generator(backend, ckpt.config, limits, ex, sched)

    def gen(spec, params, stops=()):
        sched.speculation, sched.spec_counters = spec, SpecCounters()
        (r,), _ = g.generate([prompt], new_tokens, params, StopRules.of(tok, strings=list(stops)))
        return r, sched.spec_counters

    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=5)):
        plain, _ = gen(None, params)
        fast, counters = gen(NGRAM, params)
        assert fast.token_ids == plain.token_ids and fast.text == plain.text and counters.num_drafts > 0
        assert fast.cached_tokens > 0
        stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
        if stop.strip():
            a, _ = gen(None, params, [stop])
            b, _ = gen(NGRAM, params, [stop])
            assert (b.text, b.finish_reason, b.token_ids) == (a.text, a.finish_reason, a.token_ids)


@pytest.mark.slow
def test_generate_json_reports_the_accepted_length(tiny_ckpt, tiny_export, capsys):
    from k2trt.cli import main

    args = ["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--json", "--max-new-tokens", "24",
            "--prompt", "a b c a b c a b c"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["token_ids"] == plain["token_ids"] and "speculative" not in plain
    spec = fast["speculative"]
    assert spec["method"] == "ngram" and spec["num_drafts"] >= 0
    assert spec["mean_accepted_length"] is None or spec["mean_accepted_length"] >= 1


@pytest.mark.slow
def test_the_server_speculates_with_the_same_text_and_counts_it(tiny_ckpt, tiny_export, tmp_path):
    """serve --speculative-config, prompt lookup and an EAGLE-3 draft: the text of a greedy and a seeded completion
    (streamed too) and of a greedy and a seeded chat under a json_schema grammar equals the plain server's, and
    /metrics has vLLM's speculative-decoding counters."""
    from k2trt.tiny.draft import make_tiny_draft

    import httpx
    from servers import HANG_S, InProcessServer, metric

    body = {"model": "tiny", "prompt": "one two three one two three one two three", "max_tokens": 40}
    schema = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a a a a"}], "max_tokens": 30,
            "response_format": schema}
    asks = [{**body, "temperature": 0}, {**body, "temperature": 0.8, "seed": 3},
            {**chat, "temperature": 0}, {**chat, "temperature": 0.9, "seed": 4}]  # every verify position masked

    def answers(s):
        out = []
        for ask in asks:
            if "messages" in ask:  # the chat API, under its grammar
                answer = httpx.post(s.url + "/v1/chat/completions", json=ask, timeout=HANG_S).json()
                out.append(answer["choices"][0]["message"]["content"])
                continue
            out.append(httpx.post(s.url + "/v1/completions", json=ask, timeout=HANG_S).json()["choices"][0]["text"])
            with httpx.stream("POST", s.url + "/v1/completions", json={**ask, "stream": True}, timeout=HANG_S) as r:
                out.append("".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                   if line.startswith("data: {")))
        return out

    with InProcessServer(tiny_ckpt, tiny_export) as s:
        plain = answers(s)
    draft = make_tiny_draft(tmp_path / "draft", "llama")
    for config in ('{"method": "ngram", "num_speculative_tokens": 4}',
                   json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})):
        with InProcessServer(tiny_ckpt, tiny_export, "--speculative-config", config) as s:
            assert answers(s) == plain, config
            drafts = metric(s.url, "k2trt:spec_decode_num_drafts_total")
            proposed = metric(s.url, "k2trt:spec_decode_num_draft_tokens_total")
            accepted = metric(s.url, "k2trt:spec_decode_num_accepted_tokens_total")
            assert proposed >= drafts >= 0 and accepted <= proposed
            assert "k2trt:spec_decode_num_drafts_total" in httpx.get(s.url + "/metrics", timeout=HANG_S).text


@pytest.mark.slow
def test_the_speculation_bench_reports_ratios_and_the_same_tokens(tiny_ckpt, tiny_export, capsys):
    from k2trt.tools import spec_bench

    assert spec_bench.main(["--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--new-tokens", "16",
                            "--repeat", "1", "--batch", "2", "--kinds", "repeats,rejects", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["kind"] for r in rows] == ["repeats", "rejects"] and all(r["same_tokens"] for r in rows)
    assert all(r["ratio"] > 0 and r["batch"] == 2 for r in rows)
    assert rows[1]["drafts"] > 0  # every suffix of the second copy was seen in the first


@pytest.mark.slow
@pytest.mark.parametrize("layout, sampling", [
    (["--pipeline", "2"], ["--temperature", "0"]),
    (["--expert-parallel", "2"], ["--temperature", "0.8", "--seed", "3"]),
    (["--pipeline", "2", "--micro-batches", "2"], ["--temperature", "0.8", "--seed", "5"]),
], ids=["2-stages-greedy", "2-ep-ranks-seeded", "2-stages-2-micro-batches-seeded"])
def test_stages_and_expert_parallel_ranks_verify_drafts_with_the_same_tokens(tiny_ckpt, tiny_export, tiny_ep_exports,
                                                                             layout, sampling):
    """Drafts verified on the last stage (each rank its own sequences), the kept tokens sent back with the ids: the
    tokens of one process without speculation. The prompt holds nearly every token of the vocabulary, so the first
    step the speed policy lets propose has drafts whatever the model writes."""
    import subprocess
    import sys

    from k2trt.runtime.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(tiny_ckpt)
    prompt = tok.decode(list(range(3, TINY.vocab_size - 256)))
    onnx = tiny_ep_exports[2] if "--expert-parallel" in layout else tiny_export
    base = ["generate", "--model", str(tiny_ckpt), "--onnx", str(onnx), "--json", "--max-new-tokens", "16",
            "--prompt", prompt, "--max-context", "4096", *sampling]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']

    def gen(extra):
        r = subprocess.run([sys.executable, "-m", "k2trt.cli", *base, *extra], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    def gen_here(extra):  # one process needs no interpreter of its own
        import contextlib
        import io

        from k2trt.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*base, *extra]) == 0
        return json.loads(out.getvalue())

    alone = gen_here(["--onnx", str(tiny_export)])
    spread = gen([*layout, *spec])
    assert spread["token_ids"] == alone["token_ids"]
    assert spread["speculative"]["num_drafts"] > 0
