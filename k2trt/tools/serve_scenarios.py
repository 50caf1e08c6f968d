"""`k2trt bench-serve --scenario multi-turn | shared-prefix`: what a prefix cache is for, measured against a live
server (issue 23). Each timed request has a control of the same length in the same run that shares nothing with
what came before (its first token differs), so the ratio of their times to first token is what reuse saves,
whatever the machine's speed; with no prefix cache the ratio is about 1.

- multi-turn: one conversation of --turns turns, as an agent sends it: each turn's prompt is the previous turn's
  prompt, a reply and --turn-tokens new tokens (the reply is --max-tokens fixed ids, not the generated ones, so the
  prompts are the same in every run).
- shared-prefix: --requests requests that share a --prefix-tokens prefix, each with its own --turn-tokens suffix,
  sent one after another after one request has warmed the prefix.
- long-and-short: what the paged cache holds for one long sequence (--prefix-tokens) beside --requests − 1 short
  ones (--turn-tokens), all running at once: the most positions its pages in use spanned against the most positions
  the sequences held (the server's high-water marks in /metrics), and what one region per slot sized to the longest
  would hold.

The server's `usage.prompt_tokens_details.cached_tokens` is reported where it answers one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from k2trt.errors import K2Error
from k2trt.tools.sse_client import auth_headers, stream_chunks

SCENARIOS = ("multi-turn", "shared-prefix", "long-and-short")


@dataclass
class Timed:
    prompt_tokens: int
    ttft_s: float
    cached_tokens: int | None


@dataclass
class Pair:
    label: str
    reused: Timed  # the request whose prefix came before
    control: Timed  # the same length, sharing nothing

    @property
    def ratio(self) -> float:
        return self.reused.ttft_s / self.control.ttft_s

    def row(self) -> dict:
        return {"request": self.label, "prompt_tokens": self.reused.prompt_tokens,
                "cached_tokens": self.reused.cached_tokens, "ttft_ms": round(1000 * self.reused.ttft_s, 1),
                "control_ttft_ms": round(1000 * self.control.ttft_s, 1), "ttft_ratio": round(self.ratio, 3)}


async def timed_completion(client, url: str, model: str, prompt: list[int], max_tokens: int) -> Timed:
    """One streamed completion of token ids: the time to its first text, and the cached tokens its usage names."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, cached = time.perf_counter(), None, None
    async for chunk in stream_chunks(client, url, body):
        if chunk.get("usage"):
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
            first = time.perf_counter()
    if first is None:
        raise K2Error("a request streamed no text")
    return Timed(len(prompt), first - t0, cached)


def _control(prompt: list[int], rng: random.Random, vocab: int) -> list[int]:
    """Random ids of the same length whose first differs from the prompt's: no prefix in common with anything."""
    out = [rng.randrange(vocab) for _ in prompt]
    out[0] = (prompt[0] + 1) % vocab
    return out


async def multi_turn(client, url: str, model: str, vocab: int, turns: int, turn_tokens: int,
                     max_tokens: int) -> list[Pair]:
    rng = random.Random(2)
    prompt: list[int] = []
    pairs = []
    for turn in range(1, turns + 1):
        if turn > 1:
            prompt += [rng.randrange(vocab) for _ in range(max_tokens)]  # the reply, as the next turn resends it
        prompt += [rng.randrange(vocab) for _ in range(turn_tokens)]
        reused = await timed_completion(client, url, model, prompt, max_tokens)
        control = await timed_completion(client, url, model, _control(prompt, rng, vocab), max_tokens)
        pairs.append(Pair(f"turn {turn}", reused, control))
    return pairs


async def shared_prefix(client, url: str, model: str, vocab: int, requests: int, prefix_tokens: int,
                        turn_tokens: int, max_tokens: int) -> list[Pair]:
    rng = random.Random(3)
    prefix = [rng.randrange(vocab) for _ in range(prefix_tokens)]
    await timed_completion(client, url, model, prefix + [rng.randrange(vocab) for _ in range(turn_tokens)],
                           max_tokens)  # the first user of the prefix pays for it
    pairs = []
    for i in range(1, requests + 1):
        prompt = prefix + [rng.randrange(vocab) for _ in range(turn_tokens)]
        reused = await timed_completion(client, url, model, prompt, max_tokens)
        control = await timed_completion(client, url, model, _control(prompt, rng, vocab), max_tokens)
        pairs.append(Pair(f"request {i}", reused, control))
    return pairs


@dataclass
class Occupancy:
    """The cache at its peak: the positions its pages in use span and the positions the running sequences hold
    then; `per_slot` is what one region per slot, each the longest sequence's length, would hold."""
    sequences: int
    in_use: int
    held: int
    per_slot: int

    @property
    def ratio(self) -> float:
        return self.in_use / self.held

    def row(self) -> dict:
        return {"sequences": self.sequences, "positions_in_use": self.in_use, "positions_held": self.held,
                "ratio": round(self.ratio, 3), "per_slot_positions": self.per_slot,
                "per_slot_ratio": round(self.per_slot / self.held, 3)}


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("k2trt:cache_peak_positions_"):
            name, value = line.split()
            out[name] = float(value)
    return out


async def long_and_short(client, url: str, model: str, vocab: int, requests: int, long_tokens: int,
                         short_tokens: int, max_tokens: int) -> Occupancy:
    """All at once, each generating max_tokens: the server's high-water marks (k2trt:cache_peak_positions_*, kept
    by its scheduler after every step) are then this scenario's, the warm-up's being far lower."""
    rng = random.Random(4)
    prompts = [[rng.randrange(vocab) for _ in range(long_tokens)]] + \
        [[rng.randrange(vocab) for _ in range(short_tokens)] for _ in range(requests - 1)]
    await asyncio.gather(*(timed_completion(client, url, model, p, max_tokens) for p in prompts))
    g = _gauges((await client.get(url + "/metrics")).text)
    if not g.get("k2trt:cache_peak_positions_held"):
        raise K2Error("the server reports no k2trt:cache_peak_positions_held (not a k2trt server?)")
    return Occupancy(requests, int(g["k2trt:cache_peak_positions_in_use"]), int(g["k2trt:cache_peak_positions_held"]),
                     requests * (long_tokens + max_tokens))


def run_scenario(url: str, model: str, vocab: int, args) -> list[Pair] | Occupancy:
    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=600, headers=auth_headers(args.api_key)) as client:
            await timed_completion(client, url, model, [1, 2, 3, 4], 2)  # warm-up
            if args.scenario == "multi-turn":
                return await multi_turn(client, url, model, vocab, args.turns, args.turn_tokens, args.max_tokens)
            if args.scenario == "long-and-short":
                return await long_and_short(client, url, model, vocab, args.requests, args.prefix_tokens,
                                            args.turn_tokens, args.max_tokens)
            return await shared_prefix(client, url, model, vocab, args.requests, args.prefix_tokens,
                                       args.turn_tokens, args.max_tokens)

    return asyncio.run(main())


def render_occupancy(o: Occupancy) -> str:
    cells = [["cache", "positions", "× held"], ["-"] * 3,
             ["paged: pages in use at the peak", f"{o.in_use:,}", f"{o.ratio:.2f}"],
             ["the most the sequences held", f"{o.held:,}", "1.00"],
             ["one region per slot, each the longest", f"{o.per_slot:,}", f"{o.per_slot / o.held:.2f}"]]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))
             for c in cells]
    lines[1] = "  ".join("-" * w for w in widths)
    lines.append(f"long-and-short: 1 long + {o.sequences - 1} short sequences; the pages in use span "
                 f"{o.ratio:.2f}x the positions held")
    return "\n".join(lines)


def render(scenario: str, pairs: list[Pair]) -> str:
    cols = ["request", "prompt_tokens", "cached_tokens", "ttft_ms", "control_ttft_ms", "ttft_ratio"]
    heads = ["request", "prompt tokens", "cached", "TTFT ms", "control TTFT ms", "TTFT ratio"]
    cells = [heads] + [["-" if r[c] is None else str(r[c]) for c in cols] for r in (p.row() for p in pairs)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(c, widths)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    last = pairs[-1]
    lines.append(f"{scenario}: the last request's time to first token is {last.ratio:.2f}x its control's "
                 f"({last.reused.prompt_tokens} prompt tokens, "
                 f"{'none' if last.reused.cached_tokens is None else last.reused.cached_tokens} reported cached)")
    return "\n".join(lines)
