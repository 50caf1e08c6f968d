"""The result of `k2trt compare`: one row per block output (or end-to-end check), printed as one table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    block: str
    backend: str
    output: str
    max_abs: float | None
    max_rel: float | None  # max |diff| / max |ref|
    cosine: float | None
    tol: str
    passed: bool

    def cells(self) -> list[str]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        return [self.block, self.backend, self.output, f(self.max_abs, ".3g"), f(self.max_rel, ".3g"),
                f(self.cosine, ".7f"), self.tol, "pass" if self.passed else "FAIL"]


HEADER = ["block", "backend", "output", "max abs", "max rel", "cosine", "atol / rtol", "result"]


def format_table(rows: list[Row]) -> str:
    cells = [HEADER] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(c) for c in cells[1:]])


@dataclass
class Report:
    rows: list[Row]

    @property
    def failed_blocks(self) -> list[str]:
        seen = []
        for r in self.rows:
            if not r.passed and f"{r.block} ({r.backend})" not in seen:
                seen.append(f"{r.block} ({r.backend})")
        return seen

    @property
    def passed(self) -> bool:
        return not self.failed_blocks

    def summary(self) -> str:
        if self.passed:
            return f"compare: all {len(self.rows)} checks passed"
        return f"compare: FAILED: {', '.join(self.failed_blocks)}"
