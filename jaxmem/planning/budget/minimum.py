"""The lowest peak a budget search that cannot fit reports, and the rewritten steps'
bound it rules plans out by (part of the third box of the data flow, ``Analysis -> Plan``
under a budget; the search is :mod:`~jaxmem.planning.budget.search`).

Where nothing fits, :func:`lowest_reached` gives the ``BudgetError``'s minimum: the lowest
rewritten step the liveness model predicts among the plans ruled out by prediction (not
compiled), or, where the model over-predicts the step (:data:`TRUSTED_PLAIN_MISS`) or
predicts nothing, a plan compiled for it. :func:`rewritten_over` is the rule that rules a
plan out by its rewritten step: at the step's smallest miss once a plan has compiled, at
:data:`~jaxmem.planning.budget.ranked_blocks.REWRITTEN_OVER` before. Each function reads
the search it is given, ``s`` (``search._Search``: its tries, model, budget and callbacks).
"""

from __future__ import annotations

from typing import Any

from jaxmem.planning.budget.fallbacks import Found, debug
from jaxmem.planning.budget.ranked_blocks import (
    MISS_SPREAD,
    REWRITTEN_OVER,
    rewritten_rules_out,
)
from jaxmem.planning.budget.tries import Candidate
from jaxmem.planning.budget.units import TooLargeToCompile
from jaxmem.planning.cost_model_plans import plan_from_sets
from jaxmem.planning.plan import Plan
from jaxmem.xla.measure import fmt_bytes

__all__ = ["TRUSTED_PLAIN_MISS", "lowest_reached", "rewritten_over", "sets_rewritten"]

#: The least the plain step's compiled peak may be of its predicted peak (the liveness
#: model's, ``Analysis.peak_bytes``) for the ranked search to rely on
#: :data:`~jaxmem.planning.budget.ranked_blocks.REWRITTEN_OVER` before any plan of the step
#: has compiled: a solver's plan whose rewritten step is predicted above the budget by more
#: than it is not compiled (:func:`rewritten_over`), and where nothing fits, the minimum the
#: search predicts is reported instead of compiling a plan for it (:func:`lowest_reached`).
#: A model that over-predicts the plain step further may over-predict a plan past
#: ``REWRITTEN_OVER``, and that plan may fit: the lm1b-width GPT-2 decoder (H100 target)
#: compiles its plain step to 0.82 of its prediction, its block plan to 0.68; the zoo and
#: corpus bench steps' plain steps compile to at least 0.905 of theirs on the H100 target
#: (transformers' ResNet18) and 0.839 on CPU (keras' MobileNetV2;
#: ``benchmarks/results/prediction*/prediction.json``).
TRUSTED_PLAIN_MISS = 0.9


def lowest_reached(s: Any, blk: Found | None) -> Candidate | Found | None:
    """Nothing fits. The plans ruled out by prediction are above the budget by more than
    the model's error, so none is compiled only for the error's minimum: the lowest
    :func:`predicted_lowest` is the minimum where it is below the lowest compiled
    (:attr:`BudgetError.minimum_predicted`). Compiled for it (before 2026-12-07), the
    ruled-out plan cost transformers' GPT-2 small (bench size, H100 target, budget 0.5)
    36 s of a 66 s search, to report 2.10 GiB where its rewritten step was predicted at
    2.11. Where the model over-predicts this step's plain peak past
    :data:`TRUSTED_PLAIN_MISS`, or predicts nothing, that plan is compiled as before
    (:func:`compile_lowest`): the candidate or block plan, which may fit after all."""
    s.failing()
    low = predicted_lowest(s, blk)
    if low is None or not trusted(s):
        return compile_lowest(s, low)
    debug(f"({low[1]}): not compiled for the lowest peak reached, its rewritten step "
          f"predicted {fmt_bytes(low[0])}")
    if low[0] < s.tries.lowest:
        s.tries.predicted = low[:2]
    return None


def trusted(s: Any) -> bool:
    """Whether the plain step compiled to at least :data:`TRUSTED_PLAIN_MISS` of its
    predicted peak (the bound on the rewritten steps is relied on without a miss)."""
    return s.plain >= TRUSTED_PLAIN_MISS * s.analysis.peak_bytes


def predicted_lowest(s: Any, blk: Found | None) -> tuple[int, str, Plan | None] | None:
    """The lowest rewritten-step peak the liveness model predicts among the plans ruled
    out (the block plans', :attr:`Found.predicted`; greedy's lowest plan's), scaled by the
    smallest miss (compiled over rewritten peak) of the plans this search compiled, where
    one was: ``(peak, what, the block plan or None for greedy's)``; None where none is
    predicted, or where it is within the budget (the bound that ruled the plan out says
    otherwise: no minimum to report)."""
    preds = [] if blk is None or blk.predicted is None else [
        (blk.predicted[0], f"the block plan {blk.predicted[1].strategy}", blk.predicted[1])]
    r = greedy_lowest_rewritten(s)
    if r is not None:
        preds.append((r, "greedy's lowest plan", None))
    miss = (s.rewritten_miss() if s.rewritten_miss is not None else None) or 1.0
    low = min(((int(r * miss), what, p) for r, what, p in preds), key=lambda t: t[0],
              default=None)
    return low if low is not None and low[0] > s.requested else None


def compile_lowest(s: Any, low: tuple[int, str, Plan | None] | None
                   ) -> Candidate | Found | None:
    """The plan ``low`` names compiled for the lowest peak reached: its block plan (as a
    :class:`Found` where it fits after all: the lm1b-width GPT-2 decoder's block plan
    compiled 1.47x below its rewritten step), else greedy's lowest where it may go lower
    (:func:`may_go_lower`; its candidate); or None."""
    if low is not None and low[2] is not None:
        p = low[2]
        debug(f"({p.strategy}): compiled for the lowest peak reached")
        try:
            fig = s.compile_plan(p)
        except TooLargeToCompile:
            return None
        peak = s.device_peak(p, fig)[0]
        s.tries.add(Found(None, None, 1, peak))
        return Found(p, fig, 0, peak) if peak <= s.requested else None
    if s.lowest_skipped is None or not may_go_lower(s, *s.lowest_skipped):
        return None
    s.basis.notes.append("greedy's lowest plan compiled after all, for the lowest peak "
                         "reached")
    return s.tries.check(*s.lowest_skipped, "greedy (lowest)", s.requested)


def may_go_lower(s: Any, drop: frozenset[int], off: frozenset[int]) -> bool:
    """Whether ``(drop, off)`` may compile below the lowest peak the search ``s`` reached:
    its prediction, scaled by the smallest miss (compiled over predicted peak) of the
    plans this search compiled, is below it (no miss yet: it may). The zoo Llama at
    bench size, H100 target, budget 0.5: greedy's lowest plan was predicted at 84.1
    MiB, the search's one miss was 1.52x, a block plan had reached 105.9 MiB; it
    compiled to 143.9 MiB (18.6 s of the search's 60)."""
    miss = min(s.tries.misses, default=None)
    pred = s.model.evaluate(drop, off).peak
    seen = rewritten_over(s, drop, off, s.tries.lowest)
    if seen is not None:
        s.basis.notes.append(f"greedy's lowest plan not compiled: predicted "
                             f"{fmt_bytes(seen[0])} ({seen[1]}), not below the lowest peak "
                             f"reached ({fmt_bytes(s.tries.lowest)})")
        return False
    if miss is None or pred * miss < s.tries.lowest:
        return True
    s.basis.notes.append(
        f"greedy's lowest plan not compiled: predicted {fmt_bytes(pred)}, "
        f"{fmt_bytes(pred * miss)} at this search's smallest miss ({miss:.2f}x), not "
        f"below the lowest peak reached ({fmt_bytes(s.tries.lowest)})")
    return False


def rewritten_over(s: Any, drop: frozenset[int], off: frozenset[int],
                   bar: int | None = None) -> tuple[int, str] | None:
    """Where the ranked search ``s`` puts ``(drop, off)`` over the budget by the
    rewritten steps' liveness, scaled by the smallest miss (compiled over rewritten peak)
    of the plans this search compiled less :data:`MISS_SPREAD` (plans of other kinds miss
    differently); or, given ``bar`` (the lowest peak reached, for the minimum, not a fit),
    at or above it at that miss itself: ``(that peak, why)``; else None (no plan compiled
    with its rewritten step predicted yet, or below). The zoo Llama (bench size, H100
    target, budget 0.5, 94.57 MiB): its block plan's rewritten step was predicted at
    93.55 MiB and compiled to 106.87 (1.14x); the solver's plan, predicted 111.45 (106.1
    at 1.14x / 1.2), compiled to 136.72. Before any plan with its rewritten step predicted
    has compiled, where the plain step's own miss allows it (:data:`TRUSTED_PLAIN_MISS`),
    not given ``bar``: over :data:`REWRITTEN_OVER` times the budget, at that bound (equinox's
    BatchNorm CNN, bench size, H100 target, budget 0.5, 40.33 MiB: the solver's plan,
    predicted 29.65 MiB by the cost model and 59.66 by its rewritten step, compiled to
    57.69)."""
    miss = s.rewritten_miss() if s.rewritten_miss is not None and s.ranked else None
    if (s.rewritten is None or s.compile_plan is None or s.forced or not s.ranked
            or (miss is None and (bar is not None or not trusted(s)))):
        return None
    r = sets_rewritten(s, drop, off)
    if miss is None:   # no plan compiled yet: the bound (where the plain step allows it)
        if not rewritten_rules_out(r, s.requested):
            return None
        assert r is not None
        return int(r / REWRITTEN_OVER), (f"its rewritten step's {fmt_bytes(r)}, over "
                                         f"{REWRITTEN_OVER}x the budget")
    scale = miss if bar is not None else miss / MISS_SPREAD
    bar = s.requested + 1 if bar is None else bar
    if r is None or r * scale < bar:
        return None
    return int(r * scale), (f"its rewritten step's {fmt_bytes(r)} at this step's smallest "
                            f"miss, {miss:.2f}x" + ("" if scale == miss else
                                                    f" / {MISS_SPREAD}"))


def greedy_lowest_rewritten(s: Any) -> int | None:
    """The peak the liveness model predicts for greedy's lowest plan's rewritten step,
    where the ranked search ``s`` ruled that plan out (the error's minimum where nothing
    fits, :func:`lowest_reached`); None otherwise. Transformers' ResNet18 (bench size,
    H100 target, budget 0.5): 174.37 MiB, the error's minimum (the lowest block plan's is
    198.32); compiled (before 2026-12-07), greedy's lowest plan reaches 183.57 MiB."""
    if s.lowest_skipped is None or s.rewritten is None:
        return None
    return sets_rewritten(s, *s.lowest_skipped)


def sets_rewritten(s: Any, drop: frozenset[int], off: frozenset[int]) -> int | None:
    """``s.rewritten`` of the plan of ``(drop, off)`` as the search compiles it
    (:meth:`Tries.check`'s ``plan_from_sets``)."""
    return s.rewritten(plan_from_sets(s.model, drop, off, "budget", "budget"))
