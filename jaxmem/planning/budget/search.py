"""The budget search: plan, compile, check, re-plan (third box of the data flow,
``Analysis -> Plan`` under a budget).

:func:`plan_with_budget` runs one :class:`_Search`. It compiles the plain step (the
baseline budget fractions refer to), tries MEDL's plan, then asks a solver
(:mod:`~jaxmem.planning.budget.solvers`) for a plan whose predicted peak
meets an aim, compiles it, reads XLA's peak and moves the aim by the miss (a secant step),
at most ``max_compiles`` compiles. When the model cannot reach the aim it escalates through
:mod:`~jaxmem.planning.budget.fallbacks`: greedy's lowest plan, block plans, Chen's segments, and
last block plans with host offload. Every plan tried is a :class:`Candidate`.

Compiling is the caller's: ``compile_plan``/``compile_plain`` return XLA's figures and
``device_peak`` corrects them where the compile strips host placement, so this package never
imports the rewrite or :mod:`jaxmem.optimized`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.analyzing.tags import offload_tagged
from jaxmem.planning.budget.fallbacks import (
    DevicePeak,
    Found,
    best_block_plan,
    block_offload_plan,
    debug,
)
from jaxmem.planning.budget.solvers import exact, exact_size, greedy
from jaxmem.planning.budget.units import Budget, BudgetError, resolve_budget
from jaxmem.planning.plan import Decision, Plan
from jaxmem.planning.strategies import plan_from_sets, plan_none, plan_segments
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["Candidate", "plan_with_budget"]


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


def _next_aim(points: list[tuple[int, int]], requested: int) -> int:
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


class _Search:
    """One plan/compile/check search under a budget (see the module doc)."""

    def __init__(self, analysis: Analysis, spec: Budget, *, auto: Plan | None,
                 compile_plan: Callable[[Plan], Figures] | None,
                 compile_plain: Callable[[], Figures] | None, device_peak: DevicePeak | None,
                 offload: bool | str, solver: str, profile: DeviceProfile | str | None,
                 max_compiles: int, time_limit: float | None, node_limit: int = 5000
                 ) -> None:
        self.t_start = time.perf_counter()
        self.analysis, self.auto, self.compile_plan = analysis, auto, compile_plan
        self.solver, self.max_compiles, self.time_limit = solver, max_compiles, time_limit
        self.node_limit = node_limit
        self.device_peak = device_peak or (lambda plan, fig: (fig.peak, None))
        self.notes: list[str] = []
        if compile_plan is not None:
            self.base_fig = (compile_plain() if compile_plain is not None
                             else compile_plan(plan_none(analysis)))
            self.plain, self.compiles = self.base_fig.peak, 1
        else:
            self.base_fig, self.plain, self.compiles = None, analysis.peak_bytes, 0
            self.notes.append("not compiled: budget checked against jaxmem's predicted peak "
                              "only")
        self.requested = resolve_budget(spec.value, self.plain)
        if self.requested < analysis.argument_bytes:
            raise BudgetError(
                f"budget {fmt_bytes(self.requested)} is below the arguments' own size "
                f"{fmt_bytes(analysis.argument_bytes)}: the parameters, optimizer state and "
                "batch alone exceed it, before any activation. Shard the state across "
                "devices, offload optimizer state, use a smaller model or batch, or raise "
                "the budget.", self.requested, analysis.argument_bytes)
        self.model = CostModel(analysis, profile or spec.profile, base_peak=self.plain)
        self.forced = offload_tagged(analysis)
        self.allow_off = offload in (True, "auto")
        self.tried: dict[tuple[frozenset[int], frozenset[int]], Candidate] = {}
        self.lowest = self.plain
        self.points: list[tuple[int, int]] = []     # (model aim, compiled peak)
        # Monotone candidates: every plan tried after one that compiled over the budget
        # drops a superset of it (the compiler's peak is not the model's; a tighter plan
        # that gave back drops the last one needed could compile higher). ``floor`` is that
        # drop set.
        self.floor: frozenset[int] = frozenset()
        self.blocks: Found | None = None            # the block-plan fallback, once tried

    # -- the search ---------------------------------------------------------------------------
    def run(self) -> Plan:
        if self.plain <= self.requested and not self.forced:
            return self._finish(frozenset(), frozenset(), "budget", self.base_fig,
                                [f"the plain-jit peak {fmt_bytes(self.plain)} already fits "
                                 f"the budget {fmt_bytes(self.requested)}: nothing dropped "
                                 "(0% overhead)"])
        best, aim = self._start()
        best = self._loop(best, aim)
        compiled = self.compile_plan is not None and not self.forced
        # A block plan is tried when nothing better fits: no plan, Chen's segments, or
        # greedy's lowest-memory plan (taken because the model could not reach its aim;
        # it drops everything it can, so a block plan that fits is often cheaper in FLOPs).
        if ((best is None or best.source in ("segments", "greedy (lowest)")) and compiled
                and self.blocks is None):
            self.blocks = self._fallback(best_block_plan(self.analysis, self.requested,
                                                         self.compile_plan))
        blk = self.blocks
        if blk is not None and blk.plan is not None:
            best_flops = best.figures.flops if best is not None and best.figures else None
            if best_flops is None or blk.figures.flops < best_flops:
                return self._finish_blocks(blk)
        if best is None and (blk is None or blk.plan is None) and self.allow_off and compiled:
            # nothing save+recompute can do fits: park block boundary values in host memory
            found = self._fallback(block_offload_plan(
                self.model, self.analysis, self.requested, self.compile_plan,
                self.device_peak))
            if found.plan is not None:
                return self._finish_block_offload(found)
        if best is None and self.forced and self.plain <= self.requested:
            # offload_name tags are a request, as without a budget (verify keeps the plain
            # step when offloading them does not lower the peak): the budget comes first
            tried = [c.peak for c in self.tried.values()]
            lowest = f"; lowest tried {fmt_bytes(min(tried))}" if tried else ""
            return self._finish(frozenset(), frozenset(), "budget", self.base_fig, [
                f"no plan that keeps the {len(self.forced)} jaxmem.offload_name value(s) in "
                f"host memory fits the budget {fmt_bytes(self.requested)}{lowest}; the "
                f"plain-jit peak "
                f"{fmt_bytes(self.plain)} fits it, so the plain step runs and the tags are "
                "not applied"])
        if best is None:
            raise self._error()
        return self._finish_best(best)

    def _start(self) -> tuple[Candidate | None, int | None]:
        """MEDL's plan first (nearly free, and often enough): the fitting candidate or None,
        and the first model aim (None: nothing more to search)."""
        auto = self.auto
        if auto is None:
            return None, self.requested
        drop = frozenset(auto.recompute)
        if self.compile_plan is None or self.forced or not drop:
            self.floor = drop & self.model.candidates
            return None, self.requested
        fig = self.compile_plan(auto)
        self.compiles += 1
        self.lowest = min(self.lowest, fig.peak)
        ev = self.model.evaluate(drop, ())
        cand = Candidate(drop, frozenset(), "auto (MEDL)", ev.time, fig.peak, fig)
        self.tried[(drop, frozenset())] = cand
        self.points.append((ev.peak, fig.peak))
        if fig.peak <= self.requested:
            return cand, None
        self.floor = drop & self.model.candidates
        return None, _next_aim(self.points, self.requested)

    def _stages(self) -> Iterator[str]:
        """What to try, in order, when the model cannot reach its aim."""
        yield "lowest"              # greedy's lowest-memory plan
        if self.compile_plan is not None and not self.forced:
            yield "blocks"          # about one forward pass of FLOPs, fast to compile
        yield "segments"            # Chen's sqrt(n), only if no block plan fits

    def _loop(self, best: Candidate | None, aim: int | None) -> Candidate | None:
        """Solve for the aim, check, move the aim by the miss; escalate when the model
        cannot reach it. Returns the cheapest fitting candidate, or None."""
        stages = self._stages()
        for _ in range(max(1, self.max_compiles - self.compiles) + 2):
            if aim is None:
                break
            d, o, fits_model, source = self._solve(aim)
            if not fits_model:
                stage = next(stages, None)
                if stage is None or (stage != "lowest" and best is not None):
                    break   # a plan already fits; the model cannot find a cheaper one
                if stage == "blocks":
                    self.blocks = self._fallback(best_block_plan(
                        self.analysis, self.requested, self.compile_plan))
                    if self.blocks.plan is not None:
                        break
                    continue
                d, o, source = self._fallback_sets(stage)
            cand = self._check((d | self.floor) - o, o, source, aim)
            if cand is None:
                break       # out of compiles
            if cand.peak <= self.requested:
                if best is None or cand.time < best.time:
                    best = cand
                if (self.requested - cand.peak < 0.05 * self.requested
                        or self.compile_plan is None or source != "greedy"):
                    break
            else:
                self.floor = cand.drop
                if source == "segments":
                    break
            new_aim = _next_aim(self.points, self.requested)
            if new_aim == aim and fits_model:
                break
            aim = new_aim
        return best

    def _fallback_sets(self, stage: str) -> tuple[frozenset[int], frozenset[int], str]:
        if stage == "lowest":   # the model cannot reach the aim: its lowest-memory plan
            d, o, _ = greedy(self.model, 0, allow_offload=self.allow_off,
                             forced_offload=self.forced, start=self.floor)
            return d, o, "greedy (lowest)"
        segs = plan_segments(self.analysis, profile=self.model.profile)
        return segs.recompute, frozenset(), "segments"

    def _fallback(self, found: Found) -> Found:
        self.compiles += found.compiles
        self.lowest = min(self.lowest, found.lowest or self.lowest)
        return found

    def _check(self, d: frozenset[int], o: frozenset[int], source: str, aim: int
               ) -> Candidate | None:
        """Compile (or, without a compiler, predict) the plan of ``(d, o)``; None when the
        compile budget is spent. Each pair is compiled once."""
        ev = self.model.evaluate(d, o)
        done = self.tried.get((d, o))
        if done is not None:
            peak, fig, notes = done.peak, done.figures, done.notes
        elif self.compile_plan is not None:
            if self.compiles >= self.max_compiles:
                return None
            plan = plan_from_sets(self.model, d, o, "budget", "budget")
            fig = self.compile_plan(plan)
            self.compiles += 1
            peak, note = self.device_peak(plan, fig)
            notes = (note,) if note else ()
        else:
            fig, peak, notes = None, ev.peak, ()
        cand = Candidate(d, o, source, ev.time, peak, fig, notes)
        self.tried.setdefault((d, o), cand)
        self.lowest = min(self.lowest, peak)
        self.points.append((aim, peak))
        debug(f"({source}): aim {fmt_bytes(aim)}, predicted {fmt_bytes(ev.peak)}, "
              f"compiled {fmt_bytes(peak)}, drop {len(d)}, offload {len(o)}")
        return cand

    def _solve(self, aim: int, max_exact_vars: int = 6000
               ) -> tuple[frozenset[int], frozenset[int], bool, str]:
        """A plan under ``aim`` from the chosen solver: ``(drop, offload, fits, source)``."""
        model, start = self.model, self.floor
        if self.solver in ("auto", "exact"):
            size = exact_size(model)
            if size > 4 * max_exact_vars and self.solver == "exact":
                self.notes.append(f"exact solver skipped: {size} chain variables is too "
                                  "many; used greedy")
            elif size <= max_exact_vars or self.solver == "exact":
                found = self._solve_exact(aim)
                if found is not None:
                    return found
        d, o, fits = greedy(model, aim, allow_offload=self.allow_off,
                            forced_offload=self.forced, start=start)
        if self.allow_off:
            # offload allowed is a superset of the choices: never return a plan the model
            # says is slower than (or does not fit where) the recompute-only one does
            rd, ro, rfits = greedy(model, aim, forced_offload=self.forced, start=start)
            if rfits and (not fits or model.evaluate(rd, ro).time
                          <= model.evaluate(d, o).time):
                return rd, ro, True, "greedy"
        return d, o, fits, "greedy"

    def _solve_exact(self, aim: int) -> tuple[frozenset[int], frozenset[int], bool, str] | None:
        """The MILP's plan (or greedy's, when the MILP timed out with a worse one); None to
        fall back to greedy."""
        model, limit = self.model, self.time_limit
        t0 = time.perf_counter()
        d, o, status = exact(model, aim, allow_offload=self.allow_off,
                             forced_offload=self.forced, node_limit=self.node_limit,
                             time_limit=limit)
        dt = time.perf_counter() - t0
        if status == "optimal" or (status == "work limit" and (d or o)):
            ev = model.evaluate(d, o)
            if status != "optimal":
                gd, go, gfits = greedy(model, aim, allow_offload=self.allow_off,
                                       forced_offload=self.forced, start=self.floor)
                if gfits and model.evaluate(gd, go).time < ev.time:
                    self.notes.append(f"exact solver hit its {self._limits()}; greedy's "
                                      "plan was better and is used")
                    return gd, go, True, "greedy"
                self.notes.append(f"exact solver hit its {self._limits()}: best "
                                  "solution found, maybe not optimal")
            return d, o, ev.peak <= aim, f"exact ({status}, {dt:.2f} s)"
        if status == "infeasible":
            return frozenset(), frozenset(), False, "exact (infeasible)"
        self.notes.append(f"exact solver: {status} after {dt:.1f} s; fell back to greedy")
        return None

    def _limits(self) -> str:
        return (f"limit of {self.node_limit} nodes"
                + (f" or {self.time_limit:g} s" if self.time_limit is not None else ""))

    # -- results ------------------------------------------------------------------------------
    def _elapsed(self) -> str:
        return f"{time.perf_counter() - self.t_start:.1f} s with {self.compiles} compiles"

    def _finish(self, drop: frozenset[int], off: frozenset[int], strategy: str,
                fig: Figures | None, extra: Sequence[str]) -> Plan:
        plan = plan_from_sets(self.model, drop, off, strategy, "budget", self.requested,
                              notes=[*self.notes, *extra])
        return plan.with_figures(fig, self.base_fig)

    def _finish_best(self, best: Candidate) -> Plan:
        ev = self.model.evaluate(best.drop, best.off)
        fig = best.figures
        summary = (f"planned by {best.source} in {self._elapsed()} (profile "
                   f"{self.model.profile.name}): predicted peak {fmt_bytes(ev.peak)}"
                   + (f", compiled peak {fmt_bytes(fig.peak)}" if fig is not None else "")
                   + f", predicted extra step time {1e3 * ev.time:.3f} ms"
                   + (f" ({1e3 * ev.transfer_time:.3f} ms exposed transfer)"
                      if best.off else ""))
        return self._finish(best.drop, best.off, f"budget:{best.source.split(' ')[0]}", fig,
                            [summary, *best.notes])

    def _finish_blocks(self, found: Found) -> Plan:
        blk, fig = found.plan, found.figures
        note = (f"planned as blocks (depth {blk.region_depth}) in {self._elapsed()}: values "
                "crossing blocks kept, each block re-run once in the backward pass; "
                f"compiled peak {fmt_bytes(fig.peak)}, predicted recompute "
                f"{100 * blk.recompute_flops / max(blk.baseline_flops, 1):.1f}% FLOPs")
        return dataclasses.replace(blk, strategy="budget:blocks", budget=self.requested,
                                   notes=(*self.notes, note)).with_figures(fig, self.base_fig)

    def _finish_block_offload(self, found: Found) -> Plan:
        blk, fig = found.plan, found.figures
        parked = sum(c.residual.nbytes for c in blk.of(Decision.OFFLOAD))
        note = (f"planned as blocks (depth {blk.region_depth}) with {len(blk.offload)} "
                f"boundary values ({fmt_bytes(parked)}) in host memory, in "
                f"{self._elapsed()} (profile {self.model.profile.name}): device peak "
                f"{fmt_bytes(found.device_peak)}, predicted extra step time "
                f"{1e3 * found.time:.3f} ms (exposed transfer "
                f"{1e3 * self.model.transfer(blk.offload, blk.region_depth):.3f} ms); no plan "
                "without offload fits")
        return dataclasses.replace(
            blk, strategy="budget:blocks+offload", budget=self.requested,
            notes=(*self.notes, note, *([found.note] if found.note else ()))
        ).with_figures(fig, self.base_fig)

    def _error(self) -> BudgetError:
        return BudgetError(
            f"no plan fits the budget {fmt_bytes(self.requested)}: the lowest peak jaxmem "
            f"reached is {fmt_bytes(self.lowest)} (plain jit: {fmt_bytes(self.plain)}; "
            f"{self.compiles} compiles). Try offload=True to park residuals in host memory"
            + (" (already on)" if self.allow_off else "")
            + ", jaxmem.chunked for a bottleneck layer (a wide MLP, an LM head), a smaller "
            "batch, or a larger budget.", self.requested, self.lowest)


def plan_with_budget(analysis: Analysis, budget: Any, *, auto: Plan | None = None,
                     compile_plan: Callable[[Plan], Figures] | None = None,
                     compile_plain: Callable[[], Figures] | None = None,
                     device_peak: DevicePeak | None = None,
                     offload: bool | str = False, solver: str | None = None,
                     profile: DeviceProfile | str | None = None,
                     max_compiles: int | None = None, time_limit: float | None = None
                     ) -> Plan:
    """Plan ``analysis`` under ``budget``; compile in the loop when ``compile_plan`` is given.

    Args:
      analysis: the step's :class:`~jaxmem.analyzing.analysis.Analysis`.
      budget: bytes, ``"6GiB"``, a fraction in (0, 1], or a :class:`Budget`.
      auto: the default (MEDL) plan, tried first and used to seed the solvers.
      compile_plan: ``plan -> Figures`` (rewrite, jit and compile the jaxmem way). Without it
        the plan is checked against the model only (and says so).
      compile_plain: ``() -> Figures`` of the user's step under plain ``jax.jit``, compiled
        the same way: what budget fractions and overheads are relative to. Default: the
        rewritten step with nothing dropped (``compile_plan(plan_none(analysis))``), which
        can already be smaller (lean substitutes, narrow masks kept narrow).
      device_peak: ``(plan, figures) -> (device peak, note)``, the peak checked against the
        budget; default XLA's compiled peak. ``jaxmem.optimize`` passes
        :func:`jaxmem.optimized.device_peak`, which corrects CPU compiles of offloading
        plans (XLA:CPU strips host placement).
      offload: ``False`` (never offload, except values tagged with ``offload_name``),
        ``True`` or ``"auto"`` (the planner weighs offload against recompute).
      solver, profile, max_compiles, time_limit: override the :class:`Budget` settings.

    Raises:
      BudgetError: if no plan fits; ``.minimum_bytes`` is the lowest peak found.
    """
    spec = budget if isinstance(budget, Budget) else Budget(budget)
    return _Search(
        analysis, spec, auto=auto, compile_plan=compile_plan, compile_plain=compile_plain,
        device_peak=device_peak, offload=offload, solver=solver or spec.solver,
        profile=profile, max_compiles=max_compiles or spec.max_compiles,
        time_limit=spec.time_limit if time_limit is None else time_limit,
        node_limit=spec.node_limit).run()
