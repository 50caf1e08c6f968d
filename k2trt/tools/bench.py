"""`k2trt bench`: prefill and decode tokens/s of the runtime (ONNX Runtime over the exported graphs) against two
baselines on the same prompts in the same run — Hugging Face transformers' DeepseekV3ForCausalLM on the same
checkpoint (FP8 dequantized to float32, its own KV cache; the optional `bench` extra) and our eager torch
reference — over a grid of batch sizes and prompt lengths. Speed is reported as ratios in one run, not as
absolute claims: each repeat runs every backend in turn on the same prompts, and the median is reported."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from k2trt.errors import K2Error, MissingDependency
from k2trt.tiny.synthetic import synthetic_prompts

RUNTIME, TRANSFORMERS, REFERENCE = "runtime", "transformers", "reference"
PHASES = ("prefill", "decode")
SANITY_PROMPT, SANITY_TOKENS = 16, 8  # the greedy tokens of transformers and the runtime must agree here


@dataclass
class Row:
    batch: int
    prompt: int
    runs: dict = field(default_factory=dict)  # backend -> phase -> [tok/s per repeat]
    agree: float | None = None  # share of sequences whose greedy tokens equal transformers'
    host_share: float | None = None  # of the runtime's step time, outside ONNX Runtime's sessions
    accepted: float | None = None  # with --speculative-config: the runtime's tokens per verify step

    def median(self, backend: str, phase: str) -> float | None:
        values = self.runs.get(backend, {}).get(phase)
        return statistics.median(values) if values else None

    def ratio(self, backend: str, phase: str) -> float | None:
        ours, theirs = self.median(RUNTIME, phase), self.median(backend, phase)
        return ours / theirs if ours and theirs else None

    def spread(self, backend: str, phase: str) -> float | None:
        """(max - min) / median over the repeats."""
        values = self.runs.get(backend, {}).get(phase)
        return (max(values) - min(values)) / statistics.median(values) if values else None

    def as_dict(self) -> dict:
        out = {"batch": self.batch, "prompt": self.prompt, "tokens_agree_with_transformers": self.agree,
               "runtime_host_share": self.host_share, "runtime_mean_accepted_length": _round(self.accepted)}
        for backend in self.runs:
            for phase in PHASES:
                out[f"{backend}_{phase}_tokens_per_s"] = _round(self.median(backend, phase))
                out[f"{backend}_{phase}_spread"] = _round(self.spread(backend, phase), 3)
                if backend != RUNTIME:
                    out[f"ratio_{phase}_runtime_over_{backend}"] = _round(self.ratio(backend, phase))
        return out


def _round(v, n: int = 2):
    return None if v is None else round(v, n)


class Runner:
    """The backends of one bench, each made once with its weights bound before anything is timed."""

    def __init__(self, args, ckpt):
        from k2trt.runtime.backends.factory import BackendChoice, open_backend
        from k2trt.runtime.generation.generator import Generator

        self.cfg, self.new_tokens = ckpt.config, args.new_tokens
        self.gens, self.hf, self.missing = {}, None, []
        wanted = [b.strip() for b in args.baselines.split(",") if b.strip()]
        unknown = set(wanted) - {TRANSFORMERS, REFERENCE}
        if unknown:
            raise K2Error(f"unknown baseline(s) {', '.join(sorted(unknown))} (choose from {TRANSFORMERS}, {REFERENCE})")
        choices = {RUNTIME: BackendChoice("ort", args.onnx)}
        if REFERENCE in wanted:
            choices[REFERENCE] = BackendChoice("torch")
        self.speculation = args.speculative_config
        for name, choice in choices.items():
            backend = open_backend(choice, ckpt)
            backend.prepare()
            speculating = name == RUNTIME and self.speculation is not None  # the baselines decode plainly
            self.gens[name] = (speculating_generator(backend, self.cfg, self.speculation) if speculating
                               else Generator(backend, self.cfg))
        if TRANSFORMERS in wanted:
            from k2trt.tools import hf_baseline

            try:
                self.hf = hf_baseline.build_hf_model(ckpt)
            except MissingDependency as e:
                self.missing.append(str(e))
        self.backends = [RUNTIME] + ([TRANSFORMERS] if self.hf is not None else []) + \
            ([REFERENCE] if REFERENCE in self.gens else [])

    def generate(self, backend: str, prompts: list[list[int]], new_tokens: int):
        """-> (new tokens of each prompt, {phase: tok/s}, host share or None)."""
        if backend == TRANSFORMERS:
            from k2trt.tools.hf_baseline import hf_generate

            tokens, t = hf_generate(self.hf, prompts, new_tokens)
            return tokens, _rates(t.as_dict()), None
        results, t = self.gens[backend].generate(prompts, new_tokens)
        return [r.token_ids for r in results], _rates(t.as_dict()), t.host_s / (t.prefill_s + t.decode_s)

    def sanity_check(self, prompts: list[list[int]]) -> None:
        """transformers must pick the runtime's greedy tokens on a short prompt, or its speed means nothing."""
        if self.hf is None:
            return
        ours, _, _ = self.generate(RUNTIME, prompts, SANITY_TOKENS)
        theirs, _, _ = self.generate(TRANSFORMERS, prompts, SANITY_TOKENS)
        if ours != theirs:
            raise K2Error(f"transformers' greedy tokens {theirs[0]} differ from the runtime's {ours[0]} on a "
                          f"{len(prompts[0])}-token prompt: the two do not run the same model")

    def row(self, batch: int, prompt: int, repeat: int) -> Row:
        prompts = synthetic_prompts(self.cfg, batch, prompt, seed=batch * 1000 + prompt)
        row = Row(batch, prompt, {b: {p: [] for p in PHASES} for b in self.backends})
        for b in self.backends:
            self.generate(b, prompts, 2)  # warm-up at this shape
        if self.speculation is not None:
            from k2trt.runtime.generation.speculation import SpecCounters

            self.gens[RUNTIME].scheduler.spec_counters = SpecCounters()  # the timed runs' only
        tokens, shares = {}, []
        for _ in range(repeat):  # every backend in turn, so load changes hit all of them alike
            for b in self.backends:
                tokens[b], rates, share = self.generate(b, prompts, self.new_tokens)
                for p in PHASES:
                    row.runs[b][p].append(rates[p])
                if share is not None and b == RUNTIME:
                    shares.append(share)
        row.host_share = statistics.median(shares)
        if self.speculation is not None:
            row.accepted = self.gens[RUNTIME].scheduler.spec_counters.mean_accepted_length
        if TRANSFORMERS in tokens:
            row.agree = sum(a == t for a, t in zip(tokens[RUNTIME], tokens[TRANSFORMERS])) / batch
        return row


def speculating_generator(backend, cfg, speculation):
    """A Generator whose scheduler speculates as --speculative-config says (an EAGLE-3 draft loaded for it)."""
    from k2trt.runtime.generation.eagle import make_drafter
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.scheduler import Scheduler

    limits = Limits.resolve(cfg, backend.limits)
    executor = StageExecutor(backend, cfg)
    drafter = make_drafter(speculation, cfg, backend.weights, backend)
    return Generator(backend, cfg, limits, executor, Scheduler(executor, cfg, limits, speculation=speculation,
                                                               drafter=drafter))


def _rates(d: dict) -> dict:
    return {p: d[f"{p}_tokens_per_s"] for p in PHASES}


def format_table(rows: list[Row], backends: list[str]) -> str:
    baselines = [b for b in backends if b != RUNTIME]
    head = ["batch", "prompt"]
    for p in PHASES:
        head += [f"{p} {b}" for b in backends] + [f"{p} ×{b[:5]}" for b in baselines]
    head += ["same tokens", "host", "spread"] + (["accepted"] if any(r.accepted is not None for r in rows) else [])
    lines = [head]
    for r in rows:
        cells = [str(r.batch), str(r.prompt)]
        for p in PHASES:
            cells += [f"{r.median(b, p):.0f}" for b in backends]
            cells += [f"{r.ratio(b, p):.2f}×" for b in baselines]
        spread = max(r.spread(RUNTIME, p) for p in PHASES)
        cells += ["-" if r.agree is None else f"{r.agree:.0%}", f"{r.host_share:.0%}", f"{spread:.0%}"]
        if len(head) > len(cells):
            cells.append("-" if r.accepted is None else f"{r.accepted:.2f}")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def run(args) -> int:
    from k2trt.checkpoint import Checkpoint

    if args.new_tokens < 2 or args.repeat < 1:
        raise K2Error("--new-tokens must be >= 2 and --repeat >= 1")
    from k2trt.runtime.distributed.world import launched

    if args.micro_batches != [1] and args.pipeline is None and not launched():
        raise K2Error("--micro-batches keeps several steps in flight through pipeline stages: give --pipeline too")
    if args.pipeline is not None or args.expert_parallel is not None or launched():
        from k2trt.tools import pipeline_bench

        return pipeline_bench.run(args)
    ckpt = Checkpoint.open(args.model)
    runner = Runner(args, ckpt)
    for line in runner.missing:
        print(f"note: {line}: transformers is left out")
    sanity = synthetic_prompts(ckpt.config, 1, SANITY_PROMPT, seed=1)
    runner.sanity_check(sanity)
    rows = []
    for batch in args.batch:
        for prompt in args.prompt_len:
            if not args.json:
                print(f"batch {batch}, prompt {prompt}, {args.new_tokens} new tokens ...", flush=True)
            rows.append(runner.row(batch, prompt, args.repeat))
    if args.json:
        spec = args.speculative_config
        print(json.dumps({"backends": runner.backends, "new_tokens": args.new_tokens, "repeat": args.repeat,
                          "missing": runner.missing, "rows": [r.as_dict() for r in rows],
                          "speculative_config": None if spec is None else spec.method}))
        return 0
    print()
    print(format_table(rows, runner.backends))
    print(f"tokens/s, median of {args.repeat} runs per backend (each run: {args.new_tokens} new tokens, greedy); "
          f"×NAME = runtime / NAME; same tokens = share of sequences whose tokens equal transformers'; "
          f"host = share of the runtime's step time outside ONNX Runtime's sessions; spread = the runtime's "
          f"(max - min) / median over the runs, the larger of prefill and decode"
          + ("; accepted = the runtime's tokens per verify step (speculating; the baselines decode plainly)"
             if args.speculative_config is not None else ""))
    return 0
