"""The budget search: plan, compile, check, re-plan (third box of the data flow,
``Analysis -> Plan`` under a budget).

:func:`plan_with_budget` runs one :class:`_Search`. It compiles the plain step (the
baseline budget fractions refer to), tries MEDL's plan, then asks a solver
(:mod:`~jaxmem.planning.budget.solvers`) for a plan whose predicted peak
meets an aim, compiles it, reads XLA's peak and moves the aim by the miss (a secant step),
at most ``max_compiles`` compiles. When the model cannot reach the aim it escalates through
:mod:`~jaxmem.planning.budget.fallbacks`: greedy's lowest plan, block plans, Chen's segments, and
last block plans with host offload. Every plan tried is a :class:`Candidate`.

This module holds the loop; beside it, :mod:`~jaxmem.planning.budget.tries` records what was
checked (each plan compiled once, the compiles spent, the points the next aim is read from),
:mod:`~jaxmem.planning.budget.solving` picks the solver for an aim, and
:mod:`~jaxmem.planning.budget.outcome` writes the answer up (the plan and its notes, or the
:class:`~jaxmem.planning.budget.units.BudgetError`).

Blocks first: where the solver's plan's rewritten step (the caller's ``rewritten``) is
predicted above the budget, the block plans are tried before that plan is compiled. The
solver's plans that miss are the search's slowest compiles (the zoo GPT at bench size,
H100 target, budget 0.5: greedy's plan, predicted 64.87 MiB by the cost model and 83.21
MiB by its rewritten step, compiled to 94.32 MiB in 38 s; re-aimed lower instead of
compiled, greedy's next two plans took 142 s and 180 s); a block plan re-runs about one
forward pass and compiles in about twice the plain step's time.

Compiling is the caller's: ``compile_plan``/``compile_plain`` return XLA's figures and
``device_peak`` corrects them where the compile strips host placement, so this package never
imports the rewrite or :mod:`jaxmem.optimized`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel, DeviceProfile
from jaxmem.analyzing.tags import offload_tagged
from jaxmem.planning.budget import outcome
from jaxmem.planning.budget.fallbacks import (
    DevicePeak,
    Found,
    best_block_plan,
    block_offload_plan,
    debug,
    plan_over,
)
from jaxmem.planning.budget.minimum import lowest_reached, rewritten_over, sets_rewritten
from jaxmem.planning.budget.ranked_blocks import (
    REWRITTEN_OVER,
    ranked_block_plan,
    rewritten_rules_out,
)
from jaxmem.planning.budget.solvers import greedy
from jaxmem.planning.budget.solving import Solved, Solving, solve
from jaxmem.planning.budget.tries import Candidate, Tries
from jaxmem.planning.budget.units import Budget, BudgetError, resolve_budget
from jaxmem.planning.cost_model_plans import plan_segments
from jaxmem.planning.medl import plan_none
from jaxmem.planning.plan import Plan
from jaxmem.xla.measure import Figures, fmt_bytes

__all__ = ["Candidate", "plan_with_budget"]


class _Search:
    """One plan/compile/check search under a budget (see the module doc).

    The re-plan loop lives here; what was checked is in ``self.tries``
    (:class:`~jaxmem.planning.budget.tries.Tries`), how a plan is asked for in ``self.how``
    (:mod:`~jaxmem.planning.budget.solving`), and the answer is written up by
    :mod:`~jaxmem.planning.budget.outcome` against ``self.basis``.
    """

    def __init__(self, analysis: Analysis, spec: Budget, *, auto: Plan | None,
                 compile_plan: Callable[[Plan], Figures] | None,
                 compile_plain: Callable[[], Figures] | None, device_peak: DevicePeak | None,
                 offload: bool | str, solver: str, profile: DeviceProfile | str | None,
                 max_compiles: int, time_limit: float | None, node_limit: int = 5000,
                 search: str = "ranked",
                 rewritten: Callable[[Plan], int | None] | None = None,
                 rewritten_miss: Callable[[], float | None] | None = None,
                 failing: Callable[[], None] | None = None) -> None:
        t_start = time.perf_counter()
        self.failing = failing or (lambda: None)
        self.analysis, self.auto, self.compile_plan = analysis, auto, compile_plan
        self.rewritten, self.ranked = rewritten, search == "ranked"
        self.rewritten_miss = rewritten_miss
        # ranked: how far the model may over-predict a plan here (nothing ruled out: 1.0)
        self.over = plan_over(analysis) if self.ranked else None
        notes: list[str] = []
        if compile_plan is not None:
            base_fig = (compile_plain() if compile_plain is not None
                        else compile_plan(plan_none(analysis)))
            plain, compiles = base_fig.peak, 1
        else:
            base_fig, plain, compiles = None, analysis.peak_bytes, 0
            notes.append("not compiled: budget checked against jaxmem's predicted peak only")
        self.plain, self.base_fig = plain, base_fig
        self.requested = resolve_budget(spec.value, plain)
        if self.requested < analysis.argument_bytes:
            raise BudgetError(
                f"budget {fmt_bytes(self.requested)} is below the arguments' own size "
                f"{fmt_bytes(analysis.argument_bytes)}: the parameters, optimizer state and "
                "batch alone exceed it, before any activation. Shard the state across "
                "devices, keep the optimizer state in host memory (offload_state=\"auto\"), "
                "use a smaller model or batch, or raise "
                "the budget.", self.requested, analysis.argument_bytes)
        self.model = CostModel(analysis, profile or spec.profile, base_peak=plain)
        self.forced = offload_tagged(analysis)
        self.how = Solving(solver, offload in (True, "auto"), self.forced, node_limit,
                           time_limit)
        self.device_peak = device_peak or (lambda plan, fig: (fig.peak, None))
        self.tries = Tries(self.model, compile_plan, self.device_peak,
                           max_compiles=max_compiles, compiles=compiles, lowest=plain)
        self.basis = outcome.Basis(self.model, self.requested, plain, base_fig, notes,
                                   t_start)
        # Monotone candidates: every plan tried after one that compiled over the budget
        # drops a superset of it (the compiler's peak is not the model's; a tighter plan
        # that gave back drops the last one needed could compile higher). ``floor`` is that
        # drop set.
        self.floor: frozenset[int] = frozenset()
        self.blocks: Found | None = None            # the block-plan fallback, once tried
        # greedy's lowest plan, when the ranked search ruled it out by prediction
        self.lowest_skipped: tuple[frozenset[int], frozenset[int]] | None = None

    # -- the search ---------------------------------------------------------------------------
    def run(self) -> Plan:
        if self.plain <= self.requested and not self.forced:
            return outcome.finish_plain(self.basis)
        best, aim = self._start()
        best = self._loop(best, aim)
        self.basis.notes.extend(self.tries.skipped)
        compiled = self.compile_plan is not None and not self.forced
        # A block plan is tried when nothing better fits: no plan, Chen's segments, or
        # greedy's lowest-memory plan (taken because the model could not reach its aim;
        # it drops everything it can, so a block plan that fits is often cheaper in FLOPs).
        if ((best is None or best.source in ("segments", "greedy (lowest)")) and compiled
                and self.blocks is None):
            self.blocks = self.tries.add(self._block_plan())
        blk = self.blocks
        if blk is not None and blk.plan is not None:
            best_flops = best.figures.flops if best is not None and best.figures else None
            if best_flops is None or blk.figures.flops < best_flops:
                return outcome.finish_blocks(self.basis, blk, self.tries.compiles)
        if (best is None and (blk is None or blk.plan is None) and self.how.allow_off
                and compiled):
            # nothing save+recompute can do fits: park block boundary values in host memory
            found = self.tries.add(block_offload_plan(
                self.model, self.analysis, self.requested, self.compile_plan,
                self.device_peak))
            if found.plan is not None:
                return outcome.finish_block_offload(self.basis, found, self.tries.compiles)
        if best is None and self.forced and self.plain <= self.requested:
            # offload_name tags are a request, as without a budget (verify keeps the plain
            # step when offloading them does not lower the peak): the budget comes first
            return outcome.tags_not_applied(self.basis, self.forced,
                                            [c.peak for c in self.tries.tried.values()])
        if best is None and compiled:   # nothing fits: the lowest peak reached, or predicted
            cand = lowest_reached(self, blk)
            if isinstance(cand, Found):   # the block plan compiled for it fits after all
                return outcome.finish_blocks(self.basis, cand, self.tries.compiles)
            if cand is not None and cand.peak <= self.requested:
                return outcome.finish_best(self.basis, cand, self.tries.compiles)
        if best is None:
            raise outcome.no_fit(self.basis, self.tries.lowest, self.tries.compiles,
                                 self.how.allow_off, self.tries.predicted)
        return outcome.finish_best(self.basis, best, self.tries.compiles)

    def _start(self) -> tuple[Candidate | None, int | None]:
        """MEDL's plan first (nearly free, and often enough): the fitting candidate or None,
        and the first model aim (None: nothing more to search)."""
        auto = self.auto
        if auto is None:
            return None, self.requested
        drop = frozenset(auto.recompute)
        if (self.compile_plan is None or self.forced or not drop
                or self._ruled_out(drop, frozenset(), "MEDL's plan")
                or _auto_rewritten_over(self, auto)):
            self.floor = drop & self.model.candidates
            return None, self.requested
        cand = self.tries.check_auto(auto)
        if cand is not None and cand.peak <= self.requested:
            return cand, None
        self.floor = drop & self.model.candidates
        if cand is None:  # too large to compile: as if ruled out
            return None, self.requested
        return None, self.tries.next_aim(self.requested)

    def _ruled_out(self, drop: frozenset[int], off: frozenset[int], what: str) -> bool:
        """Ranked: whether the model predicts ``(drop, off)`` above the budget by more than
        its largest over-prediction of a plan on the platform (:func:`plan_over`), or above
        it once scaled by the smallest miss (compiled over predicted peak) of the plans
        this search compiled, so it is not compiled (a note says so)."""
        over = self.over
        if over is None or self.compile_plan is None:
            return False
        pred = self.model.evaluate(drop, off).peak
        miss = min(self.tries.misses, default=0.0)
        if pred * (1 - over) > self.requested:
            why = f"the cost model's error on {self.analysis.platform} ({over:.0%})"
        elif pred * miss > self.requested:
            why = (f"the model's smallest miss on this step's compiled plans ({miss:.2f}x "
                   "its prediction)")
        elif (seen := rewritten_over(self, drop, off)) is not None:
            self.basis.notes.append(f"{what} not compiled: predicted {fmt_bytes(seen[0])} "
                                    f"({seen[1]}), over the budget")
            return True
        else:
            return False
        self.basis.notes.append(
            f"{what} not compiled: predicted {fmt_bytes(pred)}, above the budget by more "
            f"than {why}")
        return True

    def _blocks_first(self, d: frozenset[int], o: frozenset[int], source: str) -> bool:
        """Whether the block plans, tried (once) before the solver's plan ``(d, o)`` where
        its rewritten step is predicted over the budget, found one that fits (module doc,
        "blocks first")."""
        r = (None if (self.rewritten is None or not self.ranked or self.blocks is not None
                      or self.compile_plan is None or self.forced)
             else sets_rewritten(self, d, o))
        if r is None or r <= self.requested:
            return False
        note = f"{source} plan's rewritten step predicted at {fmt_bytes(r)}, over the budget"
        self.basis.notes.append(f"{note}: block plans tried first")
        debug(f"({source}): {note}: block plans first")
        self.blocks = self.tries.add(self._block_plan())
        return self.blocks.plan is not None

    def _block_plan(self) -> Found:
        """The block-plan fallback: ranked (:func:`ranked_block_plan`, starting from the
        model's largest miss so far) or every block plan compiled (:func:`best_block_plan`)."""
        if self.ranked:
            return ranked_block_plan(self.model, self.analysis, self.requested,
                                     self.compile_plan, ratio=self.tries.ratio(),
                                     rewritten=self.rewritten)
        return best_block_plan(self.analysis, self.requested, self.compile_plan)

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
        for _ in range(max(1, self.tries.max_compiles - self.tries.compiles) + 2):
            if aim is None:
                break
            d, o, fits_model, source = self._solve(aim)
            if not fits_model:
                stage = next(stages, None)
                if stage is None or (stage != "lowest" and best is not None):
                    break   # a plan already fits; the model cannot find a cheaper one
                if stage == "blocks":
                    if self.blocks is None:
                        self.blocks = self.tries.add(self._block_plan())
                    if self.blocks.plan is not None:
                        break
                    continue
                d, o, source = self._fallback_sets(stage)
            d = (d | self.floor) - o
            if fits_model and best is None and self._blocks_first(d, o, source):
                break   # a block plan fits
            if fits_model and (seen := rewritten_over(self, d, o)) is not None:
                # predicted to miss as this step's compiled plans missed: not compiled, read
                # as a miss (the floor and the next aim move as after one)
                self.basis.notes.append(f"{source} plan not compiled: predicted "
                                        f"{fmt_bytes(seen[0])} ({seen[1]}), over the "
                                        "budget")
                debug(f"({source}): aim {fmt_bytes(aim)}: not compiled, {seen[1]}")
                self.floor = d
                self.tries.points.append((aim, seen[0]))
                aim = self.tries.next_aim(self.requested)
                continue
            if not fits_model and self._ruled_out(d, o, f"{source} plan"):
                if stage == "lowest":   # compiled after all should nothing fit
                    self.lowest_skipped = (d, o)
                continue
            cand = self.tries.check(d, o, source, aim)
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
            new_aim = self.tries.next_aim(self.requested)
            if new_aim == aim and fits_model:
                break
            aim = new_aim
        return best

    def _solve(self, aim: int) -> Solved:
        """A plan under ``aim`` that keeps the monotone floor: ``(drop, offload, fits,
        source)``."""
        return solve(self.model, aim, self.floor, self.how, self.basis.notes)

    def _fallback_sets(self, stage: str) -> tuple[frozenset[int], frozenset[int], str]:
        if stage == "lowest":   # the model cannot reach the aim: its lowest-memory plan
            d, o, _ = greedy(self.model, 0, allow_offload=self.how.allow_off,
                             forced_offload=self.forced, start=self.floor)
            return d, o, "greedy (lowest)"
        segs = plan_segments(self.analysis, profile=self.model.profile)
        return segs.recompute, frozenset(), "segments"


def _auto_rewritten_over(s: _Search, auto: Plan) -> bool:
    """Ranked: whether MEDL's plan's rewritten step is predicted above the budget by more
    than :data:`REWRITTEN_OVER`, so it is not compiled (a note says so). Equinox's
    BatchNorm CNN (bench size, H100 target, budget 0.5, 40.33 MiB): the cost model put it
    within the budget, its rewritten step at 57.52 MiB (the error's minimum is 57.69)."""
    if not s.ranked or s.rewritten is None:
        return False
    r = s.rewritten(auto)
    if not rewritten_rules_out(r, s.requested):
        return False
    s.basis.notes.append(f"MEDL's plan not compiled: its rewritten step predicted "
                         f"{fmt_bytes(r)}, over {REWRITTEN_OVER}x the budget")
    return True


def plan_with_budget(analysis: Analysis, budget: Any, *, auto: Plan | None = None,
                     compile_plan: Callable[[Plan], Figures] | None = None,
                     compile_plain: Callable[[], Figures] | None = None,
                     device_peak: DevicePeak | None = None,
                     offload: bool | str = False, solver: str | None = None,
                     profile: DeviceProfile | str | None = None,
                     max_compiles: int | None = None, time_limit: float | None = None,
                     search: str | None = None,
                     rewritten: Callable[[Plan], int | None] | None = None,
                     rewritten_miss: Callable[[], float | None] | None = None,
                     failing: Callable[[], None] | None = None) -> Plan:
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
      solver, profile, max_compiles, time_limit, search: override the :class:`Budget`
        settings.
      rewritten: ``plan -> bytes or None``, the peak the liveness model predicts for the
        plan's rewritten step; the ranked block search compiles first the block plans it
        predicts within the budget
        (:func:`~jaxmem.planning.budget.ranked_blocks.ranked_block_plan`), and where it puts
        the solver's plan above the budget, the block plans are tried before it.
      rewritten_miss: ``() -> float or None``, the smallest compiled over rewritten peak
        of the plans compiled so far (:func:`rewritten_over`).
      failing: called when the search gives up fitting the budget (before it compiles a
        plan for the lowest peak it can reach, where it does): the caller may prepare what
        it tries after a :class:`BudgetError` (``jaxmem.optimize``: JAX's built-ins).

    Raises:
      BudgetError: if no plan fits; ``.minimum_bytes`` is the lowest peak found (compiled,
        or predicted where ``.minimum_predicted``: :data:`TRUSTED_PLAIN_MISS`).
    """
    spec = budget if isinstance(budget, Budget) else Budget(budget)
    return _Search(
        analysis, spec, auto=auto, compile_plan=compile_plan, compile_plain=compile_plain,
        device_peak=device_peak, offload=offload, solver=solver or spec.solver,
        profile=profile, max_compiles=max_compiles or spec.max_compiles,
        time_limit=spec.time_limit if time_limit is None else time_limit,
        node_limit=spec.node_limit, search=search or spec.search, rewritten=rewritten,
        rewritten_miss=rewritten_miss, failing=failing).run()
