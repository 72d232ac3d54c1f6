"""The Pareto sweep: (budget, compiled peak, FLOPs overhead) rows, printed or plotted.

Third box of the data flow, repeated: :func:`sweep` plans at each budget through a
callback. :func:`jaxmem.pareto` (in :mod:`jaxmem.optimized`) passes one that runs
``jaxmem.optimize`` at that budget, so this package never imports the entry point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxmem.planning.budget.units import BudgetError
from jaxmem.planning.plan import Plan
from jaxmem.xla.measure import fmt_bytes

__all__ = ["Pareto", "ParetoRow", "sweep"]


@dataclasses.dataclass(frozen=True)
class ParetoRow:
    """One budget of a sweep: what was asked, what compiled, at what cost."""

    budget: Any
    budget_bytes: int | None
    compiled_peak: int | None
    flops_overhead: float | None     # XLA's count: compiled / plain - 1
    predicted_overhead: float | None  # jaxmem's FLOPs count
    strategy: str
    fits: bool
    minimum_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Pareto:
    """Rows of (budget, compiled peak, FLOPs overhead); print it or ``.plot()`` it."""

    rows: tuple[ParetoRow, ...]
    plain_peak: int
    plain_flops: float


    def __str__(self) -> str:
        lines = [f"plain jit: peak {fmt_bytes(self.plain_peak)}, "
                 f"{self.plain_flops / 1e9:.3f} GFLOP",
                 f"{'budget':>12} {'bytes':>11} {'compiled':>11} {'% plain':>8} "
                 f"{'FLOPs +%':>9} {'strategy':<18}"]
        for r in self.rows:
            if r.fits:
                lines.append(
                    f"{r.budget!s:>12} {fmt_bytes(r.budget_bytes):>11} "
                    f"{fmt_bytes(r.compiled_peak):>11} "
                    f"{100 * r.compiled_peak / self.plain_peak:>7.1f}% "
                    f"{100 * r.flops_overhead:>8.2f}% {r.strategy:<18}")
            else:
                lines.append(f"{r.budget!s:>12} {fmt_bytes(r.budget_bytes or 0):>11} "
                             f"{'no plan':>11} (lowest {fmt_bytes(r.minimum_bytes or 0)})")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Compiled peak (x) against FLOPs overhead (y), one point per budget."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover
            raise ImportError("Pareto.plot needs matplotlib: pip install 'jaxmem[plot]'") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(5, 3.5))
        ok = [r for r in self.rows if r.fits]
        xs = [r.compiled_peak / 2**20 for r in ok]
        ys = [100 * r.flops_overhead for r in ok]
        ax.plot(xs, ys, "o-")
        for r, x, y in zip(ok, xs, ys, strict=True):
            ax.annotate(str(r.budget), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.axvline(self.plain_peak / 2**20, color="C7", ls="--", lw=1)
        ax.set_xlabel("compiled peak (MiB)")
        ax.set_ylabel("FLOPs overhead (%)")
        ax.set_title("jaxmem budget sweep")
        return ax


def sweep(plan_at: Callable[[Any], Plan], budgets: Sequence[Any]) -> Pareto:
    """One row per budget from ``plan_at(budget)``, a compiled :class:`~jaxmem.planning.plan.Plan`;
    a :class:`BudgetError` makes a row that does not fit, with the lowest peak found."""
    rows = []
    plain_peak, plain_flops = 0, 0.0
    for b in budgets:
        try:
            plan = plan_at(b)
        except BudgetError as e:
            rows.append(ParetoRow(b, e.requested_bytes, None, None, None, "-", False,
                                  e.minimum_bytes))
            continue
        base, comp = plan.baseline, plan.compiled
        plain_peak, plain_flops = base.peak, base.flops
        rows.append(ParetoRow(
            b, plan.budget, comp.peak,
            comp.flops / base.flops - 1 if base.flops else 0.0, plan.predicted_overhead,
            plan.strategy, True))
    return Pareto(tuple(rows), plain_peak, plain_flops)
