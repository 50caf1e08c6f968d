"""bench-serve's prompts (the levels' in k2trt/tools/bench_serve.py, the prefix scenarios' in
k2trt/tools/serve_scenarios.py) and the scenarios' tables."""

import json
import random
import subprocess
import sys

import pytest

from k2trt.tools.bench_serve import bodies, chat_bodies
from k2trt.tools.serve_scenarios import _control


def test_each_level_and_seed_sends_prompts_no_earlier_request_sent():
    """A cold prompt must be cold: the warm-up (batch 0), each level and each seed draw their own prompts, so a
    server's prefix cache cannot serve a later level from an earlier one; the same seed and level repeat exactly."""
    def firsts(seed, batch):
        return [tuple(b["prompt"][:16]) for b in bodies("m", 4, 64, 8, 1000, seed, batch)]

    drawn = [firsts(seed, batch) for seed in (0, 1) for batch in (0, 1, 2)]
    flat = [p for level in drawn for p in level]
    assert len(set(flat)) == len(flat)
    assert firsts(0, 1) == firsts(0, 1)
    chats = [b["messages"][0]["content"] for batch in (1, 2)
             for b in chat_bodies(bodies("m", 4, 64, 8, 1000, 0, batch), False)]
    assert len(set(chats)) == len(chats)


def test_a_control_is_as_long_and_shares_no_prefix():
    rng = random.Random(0)
    for prompt in ([5], [0, 1, 2], [999] * 70):
        c = _control(prompt, rng, 1000)
        assert len(c) == len(prompt) and c[0] != prompt[0] and all(0 <= t < 1000 for t in c)


def bench(tiny_ckpt, tiny_export, *flags):
    r = subprocess.run([sys.executable, "-m", "k2trt.cli", "bench-serve", "--model", str(tiny_ckpt), "--onnx",
                        str(tiny_export), "--max-tokens", "2", *flags], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.slow
def test_multi_turn_resends_the_conversation_and_times_each_turn_against_a_control(tiny_ckpt, tiny_export):
    out = json.loads(bench(tiny_ckpt, tiny_export, "--scenario", "multi-turn", "--turns", "3", "--turn-tokens",
                           "40", "--json").strip().splitlines()[-1])
    rows = out["requests"]
    # each turn: the previous prompt, the reply (--max-tokens ids) and the turn's own tokens
    assert [r["prompt_tokens"] for r in rows] == [40, 82, 124] and out["scenario"] == "multi-turn"
    assert all(r["ttft_ms"] > 0 and r["control_ttft_ms"] > 0 and r["ttft_ratio"] > 0 for r in rows)


@pytest.mark.slow
def test_shared_prefix_prints_its_table(tiny_ckpt, tiny_export):
    text = bench(tiny_ckpt, tiny_export, "--scenario", "shared-prefix", "--requests", "2", "--prefix-tokens", "100",
                 "--turn-tokens", "10")
    lines = text.strip().splitlines()
    assert lines[0].split()[:3] == ["request", "prompt", "tokens"] and len(lines) == 5
    assert lines[2].split()[:3] == ["request", "1", "110"]
    assert lines[-1].startswith("shared-prefix: the last request's time to first token is")
