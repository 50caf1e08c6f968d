"""`k2trt bench --pipeline P [--expert-parallel E] [--micro-batches 1,2]`: the per-step time of P stages × E
expert-parallel ranks, in the same run as a single process on the same prompts (the first --batch and
--prompt-len), once per micro-batch count.

The user's process measures the single process first, then starts the P × E ranks (runtime/distributed/launch.py)
with that row in their environment; rank 0 measures the pipeline with each micro-batch count in turn, gathers every
rank's counters when it ends the pipeline (runtime/distributed/session.RankStats), and prints every row. With one
micro-batch the transfer share is rank 0's time in sends and receives less what the other ranks were busy with
meanwhile, over its step time. Under expert parallelism, the all-to-all share is each rank's time inside its MoE
layers' all-to-alls (waiting for the others included) over its step time, averaged over the ranks, and the bytes
moved per decode step are what all ranks sent to other ranks in decode steps, per step.
"""

from __future__ import annotations

import json
import os

from k2trt.runtime.backends.factory import BackendChoice
from k2trt.tiny.synthetic import synthetic_prompts

SINGLE_ENV = "K2TRT_BENCH_SINGLE"  # the single-process row, handed to the ranks


def measure(gen, prompts, new_tokens: int, repeat: int) -> dict:
    gen.generate(prompts, 2)  # warm-up
    best = None
    for _ in range(repeat):
        _, t = gen.generate(prompts, new_tokens)
        if best is None or t.prefill_s + t.decode_s < best.prefill_s + best.decode_s:
            best = t
    d = best.as_dict()
    d["ms_per_decode_step"] = round(1000 * best.decode_s / max(1, best.decode_steps), 3)
    return d


def single_process(args) -> dict:
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.entrypoints.model import load_model

    loaded = load_model(args, BackendChoice("ort", args.onnx), command="bench", micro_batches=1)
    if args.speculative_config is not None:
        from k2trt.tools.bench import speculating_generator

        gen = speculating_generator(loaded.backend, loaded.config, args.speculative_config)
    else:
        gen = Generator(loaded.backend, loaded.config)
    return measure(gen, prompts_of(args, loaded.config), args.new_tokens, args.repeat)


def prompts_of(args, cfg) -> list[list[int]]:
    return synthetic_prompts(cfg, args.batch[0], args.prompt_len[0])


def layout_label(stages: int, experts: int) -> str:
    return " × ".join(x for x in (f"{stages} stage{'s' * (stages != 1)}" if stages > 1 or experts == 1 else "",
                                  f"EP {experts}" if experts > 1 else "") if x)


def render(single: dict | None, rows: list[dict], stages: int, experts: int) -> str:
    head = (f"{'':<34}{'ms/decode step':>16}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ×1':>11}"
            f"{'transfer share':>16}")
    lines = [head]
    if single:
        lines.append(f"{'single process':<34}{single['ms_per_decode_step']:>16}{single['prefill_tokens_per_s']:>15}"
                     f"{single['decode_tokens_per_s']:>14}{'':>11}{'-':>16}")
    base = rows[0]["decode_tokens_per_s"]
    for row in rows:
        m = row["micro_batches"]
        label = f"{layout_label(stages, experts)}, {m} micro-batch{'es' * (m != 1)}"
        share = "-" if row["transfer_share"] is None else f"{row['transfer_share']:.1%}"
        gain = f"{row['decode_tokens_per_s'] / base:.2f}×" if base else "-"
        lines.append(f"{label:<34}{row['ms_per_decode_step']:>16}{row['prefill_tokens_per_s']:>15}"
                     f"{row['decode_tokens_per_s']:>14}{gain:>11}{share:>16}")
    if single and single["ms_per_decode_step"]:
        ratio = rows[0]["ms_per_decode_step"] / single["ms_per_decode_step"]
        lines.append(f"a decode step through {layout_label(stages, experts)} takes {ratio:.2f}x the single "
                     f"process's (one micro-batch: {rows[0]['micro_batches']})")
    if experts > 1:
        first = rows[0]
        lines.append(f"all-to-all: {first['all_to_all_share']:.1%} of each rank's step time; "
                     f"{first['bytes_per_decode_step'] / 1e3:.1f} kB moved between ranks per decode step "
                     f"({first['micro_batches']} micro-batch{'es' * (first['micro_batches'] != 1)})")
    return "\n".join(lines)


def rank_shares(stats, decode_steps: int) -> dict:
    """Of one run's timings: transfer share (rank 0), all-to-all share (mean over ranks), bytes per decode step."""
    from k2trt.runtime.distributed.session import transfer_share

    a2a = [s.exchange.seconds / s.step_s for s in stats if s.step_s]
    return {"transfer_share": round(transfer_share(stats), 4),
            "all_to_all_share": round(sum(a2a) / len(a2a), 4) if a2a else 0.0,
            "bytes_per_decode_step": sum(s.exchange.decode_bytes for s in stats) / max(1, decode_steps)}


def run(args) -> int:
    from k2trt.runtime.entrypoints.model import load_model
    from k2trt.runtime.distributed.launch import run_pipeline
    from k2trt.runtime.distributed.micro_batches import MicroBatchScheduler
    from k2trt.runtime.distributed.world import launched
    from k2trt.runtime.generation.eagle import make_drafter
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.scheduler import Scheduler

    experts = args.expert_parallel or 1
    if not launched():
        os.environ[SINGLE_ENV] = json.dumps(single_process(args))
        return run_pipeline(args.argv, (args.pipeline or 1) * experts)
    loaded = load_model(args, BackendChoice("ort", args.onnx), command="bench", micro_batches=1)
    if loaded.follower:
        loaded.session.follow()
        return 0
    leader, cfg = loaded.executor, loaded.config
    limits = loaded.limits()
    rows, mark = [], loaded.session.mark("start")
    spec = args.speculative_config
    drafter = make_drafter(spec, cfg, loaded.backend.weights, loaded.backend)
    for i, m in enumerate(args.micro_batches):
        if m > 1:
            scheduler = MicroBatchScheduler(leader, cfg, limits, m, True, spec, drafter)
        else:
            scheduler = Scheduler(leader, cfg, limits, True, spec, drafter.sibling() if drafter else None)
        gen = Generator(loaded.backend, cfg, limits, executor=leader, scheduler=scheduler)
        steps = leader.decode_steps
        row = measure(gen, prompts_of(args, cfg), args.new_tokens, args.repeat)
        earlier, mark = mark, loaded.session.mark(f"run{i}")
        # each run's own timings: the transfer share of a run of M > 1 would subtract other ranks' work that
        # overlapped rank 0's, not its waits, so it is shown for one micro-batch only
        shares = rank_shares([s.since(e) for s, e in zip(mark, earlier)], leader.decode_steps - steps)
        rows.append({"micro_batches": m, **row, **shares, "transfer_share": shares["transfer_share"] if m == 1
                     else None})
    loaded.close()
    stages = len(mark) // experts
    single = json.loads(os.environ.get(SINGLE_ENV) or "null")
    if args.json:
        print(json.dumps({"single_process": single, "stages": stages, "expert_parallel": experts,
                          "pipeline": {**rows[0], "stages": stages}, "runs": rows}))
    else:
        print(render(single, rows, stages, experts))
    return 0
