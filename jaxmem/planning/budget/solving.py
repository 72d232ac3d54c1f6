"""Which solver answers one aim of the budget search, and how its answer is read.

Part of the third box of the data flow (``Analysis -> Plan`` under a budget). For each model
aim the search (:mod:`~jaxmem.planning.budget.search`) asks :func:`solve` for the sets to
recompute and to offload. With ``solver="auto"`` the MILP
(:func:`~jaxmem.planning.budget.solvers.exact`) answers when the program has at most
``max_exact_vars`` chain variables, greedy otherwise; ``solver="exact"`` uses the MILP up to
four times that. A MILP that hits its node or time limit with a worse plan than greedy's
gives greedy's. With offload allowed, greedy's recompute-only plan is used when the model
says it is no slower. What happened is added to the search's notes.
"""

from __future__ import annotations

import dataclasses
import time

from jaxmem.analyzing.costmodel import CostModel
from jaxmem.planning.budget.solvers import exact, exact_size, greedy

__all__ = ["Solved", "Solving", "solve"]

#: ``(drop, offload, fits the aim by the model, source)``.
Solved = tuple[frozenset[int], frozenset[int], bool, str]


@dataclasses.dataclass(frozen=True)
class Solving:
    """How one search asks for plans: the solver (``"auto"``, ``"exact"`` or ``"greedy"``),
    the MILP's limits, whether the planner may offload, and the values tagged for offload
    (always offloaded)."""

    solver: str
    allow_off: bool
    forced: frozenset[int]
    node_limit: int
    time_limit: float | None

    def limits(self) -> str:
        """The MILP's limits, as a note says them."""
        return (f"limit of {self.node_limit} nodes"
                + (f" or {self.time_limit:g} s" if self.time_limit is not None else ""))


def solve(model: CostModel, aim: int, floor: frozenset[int], how: Solving, notes: list[str],
          max_exact_vars: int = 6000) -> Solved:
    """A plan under ``aim`` that drops at least ``floor``, from the chosen solver:
    ``(drop, offload, fits, source)``."""
    if how.solver in ("auto", "exact"):
        size = exact_size(model)
        if size > 4 * max_exact_vars and how.solver == "exact":
            notes.append(f"exact solver skipped: {size} chain variables is too "
                         "many; used greedy")
        elif size <= max_exact_vars or how.solver == "exact":
            found = _solve_exact(model, aim, floor, how, notes)
            if found is not None:
                return found
    d, o, fits = greedy(model, aim, allow_offload=how.allow_off,
                        forced_offload=how.forced, start=floor)
    if how.allow_off:
        # offload allowed is a superset of the choices: never return a plan the model
        # says is slower than (or does not fit where) the recompute-only one does
        rd, ro, rfits = greedy(model, aim, forced_offload=how.forced, start=floor)
        if rfits and (not fits or model.evaluate(rd, ro).time
                      <= model.evaluate(d, o).time):
            return rd, ro, True, "greedy"
    return d, o, fits, "greedy"


def _solve_exact(model: CostModel, aim: int, floor: frozenset[int], how: Solving,
                 notes: list[str]) -> Solved | None:
    """The MILP's plan (or greedy's, when the MILP timed out with a worse one); None to
    fall back to greedy."""
    t0 = time.perf_counter()
    d, o, status = exact(model, aim, allow_offload=how.allow_off,
                         forced_offload=how.forced, node_limit=how.node_limit,
                         time_limit=how.time_limit)
    dt = time.perf_counter() - t0
    if status == "optimal" or (status == "work limit" and (d or o)):
        ev = model.evaluate(d, o)
        if status != "optimal":
            gd, go, gfits = greedy(model, aim, allow_offload=how.allow_off,
                                   forced_offload=how.forced, start=floor)
            if gfits and model.evaluate(gd, go).time < ev.time:
                notes.append(f"exact solver hit its {how.limits()}; greedy's "
                             "plan was better and is used")
                return gd, go, True, "greedy"
            notes.append(f"exact solver hit its {how.limits()}: best "
                         "solution found, maybe not optimal")
        return d, o, ev.peak <= aim, f"exact ({status}, {dt:.2f} s)"
    if status == "infeasible":
        return frozenset(), frozenset(), False, "exact (infeasible)"
    notes.append(f"exact solver: {status} after {dt:.1f} s; fell back to greedy")
    return None
