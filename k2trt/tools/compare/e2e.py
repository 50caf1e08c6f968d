"""End-to-end rows: the chained backend through the runtime's generator against the reference's run — the
first-step logits, and greedy token agreement (a divergence at a near-tie of the reference passes, marked)."""

from __future__ import annotations

from k2trt.runtime.generation.generator import Generator
from k2trt.tools.compare.golden import Recorder
from k2trt.tools.compare.judge import compare_outputs, thresholds
from k2trt.tools.compare.table import Row


def e2e_rows(name: str, backend, golden, cfg, tol) -> list[Row]:
    from polygraphy.comparator import RunResults

    rec = Recorder(backend, cfg, [], paged=backend.reads_pages)  # its own cache form
    results, _ = Generator(rec, cfg).generate(golden.prompts, len(golden.tokens[0]))
    actual = RunResults()
    actual.add([{"logits": rec.logits[0]}], runner_name=name)
    rows = compare_outputs("e2e", name, [{"logits": golden.step_logits[0]}], actual, tol,
                           labels={"logits": "first-step logits"})
    atol = thresholds([{"logits": golden.step_logits[0]}], tol[0])[1]["logits"]
    agree = total = ties = 0
    ok = True
    for seq, (want, got) in enumerate(zip(golden.tokens, (r.token_ids for r in results))):
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        agree, total = agree + n, total + len(want)
        if n < len(want):
            ref = golden.step_logits[n][seq]
            if ref[want[n]] - ref[got[n]] <= atol:
                ties += 1  # the reference itself barely prefers its token: not a backend error
            else:
                ok = False
    label = f"greedy tokens {agree}/{total}" + (f" ({ties} near-tie)" if ties else "")
    rows.append(Row("e2e", name, label, None, None, None, "identical", ok))
    return rows
