"""Judging a backend's outputs against the golden ones with polygraphy's comparator: one table row per output."""

from __future__ import annotations

import math

import numpy as np

from k2trt.tools.compare.table import Row


def _cosine(a: np.ndarray | None, b: np.ndarray) -> float:
    if a is None or a.shape != b.shape:
        return -math.inf
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na and nb else float(na == nb)


def thresholds(golden: list[dict], factor: float) -> tuple[dict[str, float], dict[str, float]]:
    """Per output: (max |ref| over the golden feeds, atol = factor * that)."""
    scale = {n: max(float(np.abs(g[n]).max()) for g in golden) for n in golden[0]}
    return scale, {n: factor * s for n, s in scale.items()}


def compare_outputs(block: str, backend: str, golden: list[dict], actual, tol: tuple[float, float],
                    labels: dict[str, str] | None = None) -> list[Row]:
    """Rows for one block: polygraphy's elementwise check of `actual` (RunResults of one runner) against the
    golden outputs (one dict per feed), with atol = tol[0] * max|ref| per output."""
    from polygraphy.comparator import Comparator, RunResults, SimpleCompareFunc

    from k2trt.tools.compare.polygraphy_support import quiet

    scale, atol = thresholds(golden, tol[0])
    results = RunResults()
    results.add(golden, runner_name="reference")
    ((runner, iters),) = actual.items()
    results[runner] = iters
    with quiet():
        # (runner, reference): polygraphy's relative error divides by the second output, the reference.
        acc = Comparator.compare_accuracy(results, comparisons=[(1, 0)],
                                          compare_func=SimpleCompareFunc(atol=atol, rtol=tol[1]))
    if not hasattr(acc, "values"):  # AccuracyResults: one AccuracyResult per compare func
        acc = acc[0]
    per_iter = next(iter(acc.values()))
    rows = []
    for n in golden[0]:
        checks = [it.get(n, False) for it in per_iter]
        # A bare False (a missing output or a shape mismatch) carries no metrics.
        max_abs = float(np.max([float(getattr(c, "max_absdiff", math.inf)) for c in checks]))  # NaN stays NaN
        cos = float(np.min([_cosine(it[n] if n in it else None, g[n]) for it, g in zip(iters, golden)]))
        rows.append(Row(block, backend, (labels or {}).get(n, n), max_abs, max_abs / scale[n] if scale[n] else None,
                        cos, f"{atol[n]:.1e} / {tol[1]:.0e}", all(bool(c) for c in checks)))
    return rows
