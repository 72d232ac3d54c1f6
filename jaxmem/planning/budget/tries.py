"""The budget search's record of tries: every plan it checked, and what the checks taught it.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget). The search
(:mod:`~jaxmem.planning.budget.search`) checks a plan by compiling it (through the caller's
``compile_plan``) or, without a compiler, by the cost model's prediction alone. A
:class:`Tries` holds what those checks found:

- each ``(drop, offload)`` pair checked, as a :class:`Candidate`, so no pair is compiled twice;
- the compiles spent (the plain step's included), against ``max_compiles``;
- the lowest peak seen, which a :class:`~jaxmem.planning.budget.units.BudgetError` reports;
- the ``(model aim, compiled peak)`` points :func:`next_aim` reads the next aim from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxmem.analyzing.costmodel import CostModel
from jaxmem.planning.budget.fallbacks import DevicePeak, Found, debug
from jaxmem.planning.budget.units import TooLargeToCompile
from jaxmem.planning.cost_model_plans import plan_from_sets
from jaxmem.planning.plan import Plan
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["Candidate", "Tries", "next_aim"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the search checked: what it drops and offloads, where it came from, and
    what it costs.

    Attributes:
      drop, off: value ids to recompute and to offload.
      source: ``"auto (MEDL)"``, ``"greedy"``, ``"greedy (lowest)"``, ``"exact (...)"`` or
        ``"segments"``.
      time: the cost model's predicted extra step time, seconds.
      peak: the peak checked against the budget: compiled (device peak), or predicted when
        nothing is compiled.
      figures: XLA's figures, when compiled.
      notes: how the peak was read (a device-peak estimate on CPU).
    """

    drop: frozenset[int]
    off: frozenset[int]
    source: str
    time: float
    peak: int
    figures: Figures | None
    notes: tuple[str, ...] = ()


def next_aim(points: list[tuple[int, int]], requested: int) -> int:
    """Next model aim: a secant step on (aim -> compiled peak) towards the budget, aiming
    2% under it; slope 1 with one point."""
    aim = 0.98 * requested
    t1, p1 = points[-1]
    slope = 1.0
    others = [(t, p) for t, p in points[:-1] if t != t1]
    if others:
        t0, p0 = min(others, key=lambda tp: abs(tp[1] - aim))
        if p1 != p0:
            slope = float(np.clip((p1 - p0) / (t1 - t0), 0.1, 10.0))
    return int(t1 + (aim - p1) / slope)


class Tries:
    """What one search has checked so far (see the module doc).

    ``compiles`` starts at the compiles already spent (1 when the plain step was compiled)
    and ``lowest`` at the plain step's peak.
    """

    def __init__(self, model: CostModel, compile_plan: Callable[[Plan], Figures] | None,
                 device_peak: DevicePeak, *, max_compiles: int, compiles: int, lowest: int
                 ) -> None:
        self.model, self.compile_plan, self.device_peak = model, compile_plan, device_peak
        self.max_compiles, self.compiles, self.lowest = max_compiles, compiles, lowest
        self.tried: dict[tuple[frozenset[int], frozenset[int]], Candidate] = {}
        self.points: list[tuple[int, int]] = []     # (model aim, compiled peak)
        self.skipped: list[str] = []                # plans not compiled, and why
        self.misses: list[float] = []               # compiled / predicted peak, each compile
        # (peak, what): a ruled-out plan's rewritten step predicted below ``lowest``, none
        # compiled for it (the search's ``_lowest_reached``): the error's minimum
        self.predicted: tuple[int, str] | None = None

    def next_aim(self, requested: int) -> int:
        """:func:`next_aim` from the points so far."""
        return next_aim(self.points, requested)

    def ratio(self) -> float:
        """The model's largest under-prediction so far (compiled over predicted peak of
        the plans compiled; 1.0 when none was under-predicted)."""
        return max([1.0, *self.misses])

    def check_auto(self, auto: Plan) -> Candidate | None:
        """Compile MEDL's plan as it is; its point is (predicted peak, compiled peak). None
        when ``compile_plan`` declines it as too large to compile (noted in
        :attr:`skipped`)."""
        drop = frozenset(auto.recompute)
        fig = self._compiled(auto, "MEDL's")
        if fig is None:
            return None
        self.compiles += 1
        self.lowest = min(self.lowest, fig.peak)
        ev = self.model.evaluate(drop, ())
        cand = Candidate(drop, frozenset(), "auto (MEDL)", ev.time, fig.peak, fig)
        self.tried[(drop, frozenset())] = cand
        self.points.append((ev.peak, fig.peak))
        if ev.peak > 0:
            self.misses.append(fig.peak / ev.peak)
        return cand

    def _compiled(self, plan: Plan, source: str) -> Figures | None:
        """``compile_plan(plan)``; None (noted in :attr:`skipped`) when it declines the plan
        as too large to compile: the search moves on."""
        try:
            return self.compile_plan(plan)
        except TooLargeToCompile as e:
            self.skipped.append(f"{source} plan not compiled: {e.note}")
            debug(f"({source}): not compiled: {e.note}")
            return None

    def check(self, d: frozenset[int], o: frozenset[int], source: str, aim: int
              ) -> Candidate | None:
        """Compile (or, without a compiler, predict) the plan of ``(d, o)``; None when the
        compile budget is spent, or when ``compile_plan`` declines the plan as too large to
        compile (:class:`~jaxmem.planning.budget.units.TooLargeToCompile`; noted in
        :attr:`skipped`). Each pair is compiled once."""
        ev = self.model.evaluate(d, o)
        done = self.tried.get((d, o))
        if done is not None:
            peak, fig, notes = done.peak, done.figures, done.notes
        elif self.compile_plan is not None:
            if self.compiles >= self.max_compiles:
                return None
            plan = plan_from_sets(self.model, d, o, "budget", "budget")
            fig = self._compiled(plan, source)
            if fig is None:
                return None
            self.compiles += 1
            peak, note = self.device_peak(plan, fig)
            notes = (note,) if note else ()
            if ev.peak > 0:
                self.misses.append(fig.peak / ev.peak)
        else:
            fig, peak, notes = None, ev.peak, ()
        cand = Candidate(d, o, source, ev.time, peak, fig, notes)
        self.tried.setdefault((d, o), cand)
        self.lowest = min(self.lowest, peak)
        self.points.append((aim, peak))
        debug(f"({source}): aim {fmt_bytes(aim)}, predicted {fmt_bytes(ev.peak)}, "
              f"compiled {fmt_bytes(peak)}, drop {len(d)}, offload {len(o)}")
        return cand

    def add(self, found: Found) -> Found:
        """Count a fallback's compiles and lowest peak; returns ``found``."""
        self.compiles += found.compiles
        self.lowest = min(self.lowest, found.lowest or self.lowest)
        return found
