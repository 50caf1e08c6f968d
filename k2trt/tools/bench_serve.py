"""`k2trt bench-serve --model DIR --onnx DIR` (`make bench-serve`): concurrent clients over HTTP against a live
server, started by this command (or --url of a running one).

At each concurrency (default 1, 4, 16) the same number of requests run, each a streamed completion of a fixed
random prompt with `ignore_eos`, so every request generates exactly --max-tokens tokens. Reported, measured at the
client: output tokens/s over the level's wall time, time to first token and inter-token latency percentiles, and
the speed-up of the highest concurrency over sequential requests (concurrency 1) in the same run.

`--structured` measures what decoding under a grammar costs: every level runs twice over the chat API, the same
requests plain and with a response_format json_schema (every step of every request masked by its grammar), and
the table adds the structured run's output tokens/s and inter-token latency as ratios of the plain run's.

`--scenario multi-turn` and `--scenario shared-prefix` measure prefix reuse instead, `--scenario long-and-short`
what the paged cache holds: k2trt/tools/serve_scenarios.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from k2trt.errors import K2Error
from k2trt.tools.serve_scenarios import run_scenario
from k2trt.tools.sse_client import auth_headers, stream_chunks


# the structured run's answer: one string longer than --max-tokens tokens can spell, so every step of every request is
# masked by its grammar and shows text, as in the plain run
STRUCTURED = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "minLength": 512}}, "required": ["answer"],
    "additionalProperties": False}}}


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class Level:
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    kind: str = "plain"

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall_s

    def row(self) -> dict:
        ttft = [s.ttft for s in self.samples]
        itl = [g for s in self.samples for g in s.gaps]
        return {"kind": self.kind, "concurrency": self.concurrency, "requests": len(self.samples),
                "output_tokens_per_s": round(self.tokens_per_s, 1),
                **{f"ttft_p{q}_ms": round(1000 * percentile(ttft, q), 1) for q in (50, 90, 99)},
                **{f"itl_p{q}_ms": round(1000 * percentile(itl, q), 2) for q in (50, 90, 99)}}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def one_request(client, url: str, body: dict) -> Sample:
    t0 = time.perf_counter()
    times, tokens = [], 0
    async for chunk in stream_chunks(client, url, body):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            times.append(time.perf_counter())
    if not times:
        raise K2Error("a request streamed no text")
    return Sample(times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens)


async def run_level(url: str, bodies: list[dict], concurrency: int, kind: str = "plain",
                    headers: dict | None = None) -> Level:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    level = Level(concurrency, 0.0, kind=kind)

    async def worker(client):
        while not queue.empty():
            level.samples.append(await one_request(client, url, queue.get_nowait()))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        level.wall_s = time.perf_counter() - t0
    return level


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`k2trt serve <serve_args>` in a child process: started on a free port, waited for until /health answers,
    stopped with SIGTERM (the way a supervisor stops it). Its output goes to `log` (a file), never to a pipe
    nobody reads."""

    def __init__(self, serve_args: list[str], log=None, startup_s: float = 300.0):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "k2trt.cli", "serve", *serve_args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise K2Error(f"the server did not start: {self.output().strip().splitlines()[-1:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.3)
        self.stop()
        raise K2Error(f"the server did not start within {startup_s:.0f} s")

    def output(self, tail: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-tail:]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not end in time; -> its exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


def serve_args(args, max_batch: int) -> list[str]:
    backend = ["--onnx", str(args.onnx)] if args.onnx else ["--engines", str(args.engines)]
    return ["--model", str(args.model), *backend, "--max-batch", str(max_batch), "--log-level", "warning",
            "--max-queue", str(10 * max_batch)]


def bodies(model: str, n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int = 0,
           batch: int = 0) -> list[dict]:
    """`n` random prompts of token ids. Each (seed, batch) draws its own, so the warm-up and every level send prompts
    no earlier request sent: a server's prefix cache finds nothing and a "cold" prompt is cold."""
    import random

    rng = random.Random(f"{seed}:{batch}")
    return [{"model": model, "prompt": [rng.randrange(vocab) for _ in range(prompt_len)], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            for _ in range(n)]


def chat_bodies(plain: list[dict], structured: bool) -> list[dict]:
    """The same requests over the chat API (each prompt's ids as one user message of words drawn by those ids, so
    fresh ids make fresh text), with the grammar or not."""
    words = ["tea", "river", "engine", "seven", "blue", "quiet", "graph", "token"]
    out = []
    for b in plain:
        text = " ".join(words[i % len(words)] for i in b["prompt"])
        body = {k: v for k, v in b.items() if k != "prompt"} | {"messages": [{"role": "user", "content": text}]}
        out.append(body | ({"response_format": STRUCTURED} if structured else {}))
    return out


def render(levels: list[Level], speedup: float) -> str:
    rows = [lv.row() for lv in levels]
    cols = ["kind", "concurrency", "requests", "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p90_ms", "itl_p99_ms"]
    heads = ["kind", "conc", "requests", "out tok/s", "TTFT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99"]
    cells = [heads] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(c, widths)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"concurrency {max(lv.concurrency for lv in levels)} over sequential requests: {speedup:.2f}x output "
                 "tokens/s")
    for plain, grammar in structured_pairs(levels):
        lines.append(f"concurrency {plain.concurrency} under a grammar: "
                     f"{grammar.tokens_per_s / plain.tokens_per_s:.3f}x output tokens/s, "
                     f"{grammar.row()['itl_p50_ms'] / plain.row()['itl_p50_ms']:.3f}x ITL p50")
    return "\n".join(lines)


def structured_pairs(levels: list[Level]) -> list[tuple[Level, Level]]:
    plain = {lv.concurrency: lv for lv in levels if lv.kind == "plain"}
    return [(plain[lv.concurrency], lv) for lv in levels if lv.kind == "json_schema"]


def run(args) -> int:
    import httpx

    levels_asked = args.concurrency
    if args.model is not None and not (args.onnx or args.engines):
        raise K2Error("give --onnx DIR or --engines DIR for the server to start")
    slots = max(levels_asked + ([args.requests] if args.scenario == "long-and-short" else []))  # all at once
    server = LiveServer(serve_args(args, slots)) if args.model is not None else None
    url = server.url if server else args.url.rstrip("/")
    headers = auth_headers(args.api_key)
    try:
        answer = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        if answer.status_code == 401:
            raise K2Error(f"{url} asks for an API key: give --api-key (or set OPENAI_API_KEY)")
        models = answer.json()["data"]
        card = models[0]
        model = args.served_model_name or card["id"]
        vocab = _vocab(args) or 1000
        if args.scenario:
            return _print_scenario(args, run_scenario(url, model, vocab, args))
        def kinds_of(batch: int, n: int) -> dict[str, list[dict]]:
            work = bodies(model, n, args.prompt_len, args.max_tokens, vocab, args.seed, batch)
            if args.structured:  # like with like: both over the chat API, the same prompts
                return {"plain": chat_bodies(work, False), "json_schema": chat_bodies(work, True)}
            return {"plain": work}

        for kind_work in kinds_of(0, 2).values():
            asyncio.run(run_level(url, kind_work, 1, headers=headers))  # warm-up
        levels = []
        for i, c in enumerate(levels_asked, start=1):
            for kind, kind_work in kinds_of(i, args.requests).items():
                print(f"bench-serve: {kind}, concurrency {c}, {args.requests} requests ...", file=sys.stderr,
                      flush=True)
                levels.append(asyncio.run(run_level(url, kind_work, c, kind, headers)))
    finally:
        if server:
            server.stop()
    plain = [lv for lv in levels if lv.kind == "plain"]
    base = next((lv for lv in plain if lv.concurrency == 1), plain[0])
    speedup = plain[-1].tokens_per_s / base.tokens_per_s
    if args.json:
        grammar = [{"concurrency": p.concurrency, "tokens_per_s_ratio": round(g.tokens_per_s / p.tokens_per_s, 3),
                    "itl_p50_ratio": round(g.row()["itl_p50_ms"] / p.row()["itl_p50_ms"], 3)}
                   for p, g in structured_pairs(levels)]
        print(json.dumps({"levels": [lv.row() for lv in levels], "speedup_over_sequential": round(speedup, 2),
                          **({"grammar_cost": grammar} if grammar else {})}))
    else:
        print(render(levels, speedup))
    return 0


def _print_scenario(args, pairs) -> int:
    from k2trt.tools.serve_scenarios import Occupancy, render_occupancy
    from k2trt.tools.serve_scenarios import render as render_scenario

    if isinstance(pairs, Occupancy):
        print(json.dumps({"scenario": args.scenario, **pairs.row()}) if args.json else render_occupancy(pairs))
        return 0
    if args.json:
        print(json.dumps({"scenario": args.scenario, "requests": [p.row() for p in pairs],
                          "last_ttft_ratio": round(pairs[-1].ratio, 3)}))
    else:
        print(render_scenario(args.scenario, pairs))
    return 0


def _vocab(args) -> int | None:
    """Prompt ids from the base vocabulary (no special tokens)."""
    if args.model is None:
        return None
    from k2trt.config import K2Config
    from k2trt.runtime.text.tokenizer import NUM_RESERVED_SPECIAL

    return K2Config.from_json(args.model).vocab_size - NUM_RESERVED_SPECIAL

