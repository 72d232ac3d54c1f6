"""What a budget falls back to when jaxmem's own plan cannot meet it, compile-checked.

Part of the fifth box (:mod:`jaxmem.compiling`). A budget is a guarantee, never a hint:
the step runs only where its compiled peak fits, else :class:`BudgetError`. When the budget
search (:mod:`jaxmem.planning.budget`) cannot meet it, :func:`candidates_within` tries the
automatic mode's own candidates (what ``optimize`` without a budget picks from), then
:func:`builtin_within` JAX's built-in policies (:data:`BUILTIN_POLICIES`) on the loss,
around each block and around the whole loss, and runs the one with the fewest FLOPs that
fits; the one that saves least, ``nothing_saveable`` per block, is compiled first, and
where it compiles far above the budget the others are not compiled (:data:`FIRST_BUILTIN`,
:data:`BUILTIN_SPREAD`; a step with no blocks: :data:`WHOLE_SPREAD`). A step with nothing
to plan (no backward pass at the top level, or ``strategy="none"``) runs as the plain step,
or with its loop and shard_map bodies planned, when that fits (:func:`unplanned_budget`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling.steps import Step, read
from jaxmem.planning import strategies
from jaxmem.planning.budget import BudgetError, resolve_budget
from jaxmem.planning.budget.ranked_blocks import (
    MISS_SPREAD,
    REWRITTEN_OVER,
    rewritten_rules_out,
)
from jaxmem.planning.budget.units import TooLargeToCompile
from jaxmem.planning.plan import Plan
from jaxmem.tracing.program import backward_in_units, from_jaxpr
from jaxmem.xla import measure
from jaxmem.xla.measure import Figures, fmt_bytes

#: The built-in policies a budget falls back to when jaxmem's own search cannot meet it.
BUILTIN_POLICIES = ("dots_saveable", "nothing_saveable")

#: The built-in compiled first, ``(policy, per_block)``: it saves a subset of what each of
#: the others saves (``dots_saveable`` also keeps matmul outputs; around the whole loss the
#: backward re-creates every block's values at once, around each block one block's), so
#: where it compiles far above the budget (:data:`BUILTIN_SPREAD`) the others are not
#: compiled (issue 37: they were four of the six to ten compiles of a budget that raises
#: ``BudgetError``).
FIRST_BUILTIN = ("nothing_saveable", True)

#: How far above the budget :data:`FIRST_BUILTIN` may compile and the others still be
#: compiled. The compiler does not always keep the subset's order: over the zoo and corpus
#: steps of ``python -m benchmarks.builtin_order`` it was the lowest of the four (or tied)
#: on every CPU step, and on the H100 target another compiled below it by up to 7.2% (the
#: MLP at test size: dots_saveable per block 241.6 KiB, nothing_saveable per block 259.1).
BUILTIN_SPREAD = 0.10

#: A step with no blocks in its names has only the whole-loss built-ins (``dots_saveable``
#: compiled first, then ``nothing_saveable``); neither saves a subset of the other as the
#: compiler schedules them, so the second is skipped only where the first compiles more than
#: this far above the budget. Over ``python -m benchmarks.builtin_order``'s steps (zoo and
#: corpus, test and bench size, CPU and the H100 target) ``nothing_saveable`` around the
#: whole loss compiled at most 14.2% below ``dots_saveable`` there (the zoo U-Net at test
#: size on CPU: 416.6 against 485.8 KiB), and up to 53% above it (the zoo GPT at bench size
#: on the H100 target): 25% above the budget leaves the second no room to fit.
WHOLE_SPREAD = 0.25


#: The most the liveness model's peak of a whole-loss built-in's program was measured above
#: its compiled peak, times, with a margin: 2.018x over the 28 whole-loss
#: ``dots_saveable`` candidates of the ``benchmarks.prediction --plans`` files (the zoo GPT
#: at bench size on the H100 target: 174.38 MiB predicted, 86.40 compiled; the model does
#: not see how XLA schedules a rematerialised whole loss). A step without blocks does not
#: compile the whole-loss built-ins where ``dots_saveable``'s prediction over this is above
#: the budget by more than :data:`WHOLE_SPREAD` (:func:`_whole_far`).
WHOLE_OVER = 2.1


#: How far below the lowest peak a budget search reached a built-in predicted to miss the
#: budget may be and still not be compiled (:func:`_first_far`): the error's minimum is
#: then within this of what compiling it would give. GPT-2 small (bench size, H100 target,
#: budget 0.5): ``nothing_saveable`` per block predicted 2.11 GiB (2.10 at the step's
#: smallest miss, 0.995x), the search's minimum 2.10; it compiled no lower (33 s).
MINIMUM_TOLERANCE = 0.01


#: The most of the automatic mode's candidates :func:`candidates_within` compiles.
CANDIDATE_COMPILES = 2


def candidates_within(error: BudgetError, analysis: Analysis, step: Step, options: Any,
                      compiles: Any, plans: list[Plan] | None = None
                      ) -> tuple[tuple[Plan, Any] | None, BudgetError]:
    """A budget the search missed, tried with the automatic mode's candidates
    (:func:`~jaxmem.planning.strategies.auto_candidates`: what ``optimize`` picks from
    without a budget), which the search's own plans do not include: its block plans
    re-create every value of a block, these keep the heavy outputs (``blocks(...,
    heavy kept)``, ``selective``). On transformers' ResNet18 (bench size, H100 target)
    ``selective(depth=5)`` compiles to 167.94 MiB where the search reached 183.57, so a
    budget between the two raised :class:`BudgetError` though ``optimize()`` fits it.

    Ranked by the peak the liveness model predicts for each rewritten step
    (``compiles.rewritten``, :class:`~jaxmem.compiling.plan_step._Compiles`), those not
    predicted above the budget at the smallest miss (compiled over rewritten peak) of the
    plans the search compiled (``compiles.rewritten_miss``) less
    :data:`~jaxmem.planning.budget.ranked_blocks.MISS_SPREAD`, or before any, by more than
    :data:`~jaxmem.planning.budget.ranked_blocks.REWRITTEN_OVER`, are compiled
    lowest first, at most :data:`CANDIDATE_COMPILES`, until one fits: that one and its
    executable, and ``error``; else None and ``error`` naming those compiled, its minimum
    the lowest peak either way. ``plans``: those candidates, where made already."""
    requested = error.requested_bytes
    if plans is None:
        plans = strategies.auto_candidates(
            analysis, max_recompute_fraction=options.max_recompute_fraction)
    known = sorted((r, k, p) for k, p in enumerate(plans)
                   if (r := compiles.rewritten(p)) is not None)
    miss = compiles.rewritten_miss()
    # this step's own misses where known (the lm1b-width GPT-2 decoder's block plan
    # compiled 1.47x below its rewritten step: REWRITTEN_OVER does not hold there)
    scale = None if miss is None else miss / MISS_SPREAD
    ranked = [t for t in known if (t[0] * scale <= requested if scale is not None
                                   else not rewritten_rules_out(t[0], requested))]
    if known and not ranked:   # none may fit: not compiled, but said (the minimum is a
        # compiled figure, and one of these may compile below it)
        r, _, p = known[0]
        why = (f"over {REWRITTEN_OVER}x the budget" if scale is None
               else f"{fmt_bytes(r * scale)} at the smallest miss of this step's compiled "
                    f"plans, {miss:.2f}x / {MISS_SPREAD}: over the budget")
        return None, error.again(
            f"{error} The automatic mode's candidates were not compiled: the lowest, "
            f"{p.strategy}, predicted at {fmt_bytes(r)} ({why}).")
    lowest, tried = error.minimum_bytes, []
    for _, _, p in ranked[:CANDIDATE_COMPILES]:
        p = dataclasses.replace(p, donated=step.donated)
        try:
            fig = compiles.plan(p)
        except TooLargeToCompile:
            continue
        lowest = min(lowest, fig.peak)
        tried.append(f"{p.strategy} {fmt_bytes(fig.peak)}")
        if fig.peak <= requested:
            note = (f"jaxmem's budget search reached {fmt_bytes(error.minimum_bytes)}, "
                    f"above the budget {fmt_bytes(requested)}; the automatic mode's "
                    f"candidate {p.strategy} (its rewritten step predicted lowest) compiled "
                    f"to {fmt_bytes(fig.peak)}")
            plan = dataclasses.replace(p, strategy=f"budget: {p.strategy}", budget=requested,
                                       notes=(*p.notes, note))
            return (plan.with_figures(fig, compiles.plain()), compiles.exe_for(p)), error
    if tried:
        error = error.again(
            f"{error} The automatic mode's candidates predicted lowest compiled to "
            f"{', '.join(tried)}.", lowest)
    return None, error


class First(NamedTuple):
    """:data:`FIRST_BUILTIN`'s program, traced, and the peak the liveness model predicts
    for it (:func:`first_builtin`)."""

    jitted: Any
    wrapped: list[str]   # the losses its trace wrapped (empty: it runs as the plain step)
    traced: Any          # None where jax.checkpoint cannot take the loss
    peak: int | None     # None where not traced or not analysed


def first_builtin(step: Step) -> First:
    """:data:`FIRST_BUILTIN` on ``step``, traced, and its liveness analysed: what
    :func:`builtin_within` reads first. It does not depend on the budget, so it is made
    while an earlier compile of the search runs (``_Compiles.beside`` in
    :mod:`jaxmem.compiling.plan_step`): the trace is most of what
    :func:`builtin_within` spends where it compiles nothing."""
    jitted, wrapped = step.loss(*FIRST_BUILTIN)
    try:
        traced = jitted.trace(*step.flat)
    except Exception:  # noqa: BLE001 - jax.checkpoint cannot take this loss
        return First(jitted, wrapped, None, None)
    return First(jitted, wrapped, traced, _traced_peak(traced, step) if wrapped else None)


def _traced_peak(traced: Any, step: Step) -> int | None:
    """The peak the liveness model predicts for a built-in's traced program (``step``'s
    donation, for its compiler); None where it cannot be analysed (compiled as before)."""
    try:
        return liveness(from_jaxpr(traced.jaxpr), donated=step.donate_flat,
                        platform=step.platform)[0]
    except Exception:  # noqa: BLE001 - compiled as before
        return None


def builtin_within(error: BudgetError, analysis: Analysis, step: Step,
                   compile_plain: Callable[[], Figures], miss: float | None = None,
                   first: First | None = None) -> tuple[Plan, Any]:
    """A budget jaxmem's search cannot meet, tried with JAX's built-in policies: the loss
    under ``jax.checkpoint(policy=dots_saveable | nothing_saveable)``, around each block
    of the name stack (what ``nn.remat`` does) and around the whole loss. The one with
    the fewest FLOPs among those whose compiled peak fits runs; none fits: ``error``
    again, its minimum the lowest peak found either way. ``miss``: the smallest compiled
    over rewritten peak of the plans the search compiled (:func:`_first_far`); ``first``:
    :func:`first_builtin`, where made already."""
    base = compile_plain()
    fits, lowest, far = _fitting_builtins(error, step, miss, first)
    if far is not None:
        raise error.again(f"{error} JAX's built-in policies were not compiled: {far[1]}.",
                          lowest) from error
    if not fits:   # (``lowest``: the search's minimum where none compiled lower)
        own = (f"compiled to {fmt_bytes(lowest)} at the lowest" if lowest < error.minimum_bytes
               else f"compiled no lower than {fmt_bytes(error.minimum_bytes)}")
        raise error.again(
            f"{error} The loss under JAX's built-in policies {own} (jax.checkpoint(block, "
            "policy=nothing_saveable) per block first, which saves least; the others "
            f"only where it compiled within {BUILTIN_SPREAD:.0%} of the budget; a step "
            "without blocks: jax.checkpoint(loss, policy=dots_saveable) first, "
            f"nothing_saveable only where that compiled within {WHOLE_SPREAD:.0%}).",
            lowest) from error
    _, _, policy, per_block, fig, exe = min(fits, key=lambda t: t[:2])
    what = (f"jax.checkpoint(block, policy={policy}) per block" if per_block
            else f"jax.checkpoint(loss, policy={policy})")
    note = (f"jaxmem's budget search reached {fmt_bytes(error.minimum_bytes)}, above the "
            f"budget {fmt_bytes(error.requested_bytes)}; the step runs as written with "
            f"its loss under {what}, which compiled to {fmt_bytes(fig.peak)}: of JAX's "
            "built-in policies that fit, the fewest FLOPs")
    plan = dataclasses.replace(
        strategies.plan_none(analysis), donated=step.donated, strategy=f"budget: {what}",
        loss_policy=policy, loss_blocks=per_block, budget=error.requested_bytes,
        recompute_flops=max(fig.flops - base.flops, 0.0), notes=(note,))
    return plan.with_figures(fig, base), exe


def _fitting_builtins(error: BudgetError, step: Step, miss: float | None = None,
                      first: First | None = None
                      ) -> tuple[list[tuple], int, tuple[int, str] | None]:
    """The built-in policies, per block and whole, compiled (:data:`FIRST_BUILTIN` first;
    the others unless it compiles above the budget by more than :data:`BUILTIN_SPREAD`;
    none where it is predicted above it by more than that and :data:`REWRITTEN_OVER`,
    :func:`_first_far`): those within the budget as ``(flops, peak, policy, per_block,
    figures, executable)``, the lowest peak seen (the search's minimum where none is
    lower), and where none was compiled the predicted peak that rules them out and why
    (:func:`_first_far`, :func:`_whole_far`; else None).
    ``first``: :func:`first_builtin`, where made already."""
    fits, lowest = [], error.minimum_bytes
    order = [FIRST_BUILTIN] + [(policy, per_block) for policy in BUILTIN_POLICIES
                               for per_block in (True, False)
                               if (policy, per_block) != FIRST_BUILTIN]
    compiled = 0
    for k, (policy, per_block) in enumerate(order):
        if k == 0:
            jitted, wrapped, traced, peak = first or first_builtin(step)
        else:
            jitted, wrapped = step.loss(policy, per_block)
            try:
                traced, peak = jitted.trace(*step.flat), None
            except Exception:  # noqa: BLE001 - jax.checkpoint cannot take this loss
                continue
        if traced is None or not wrapped:  # not traced; or no differentiated loss, or
            continue                        # no blocks in its names: plain
        if k == 0 and per_block and (pred := _first_far(peak, error, miss)):
            return fits, lowest, (pred, (   # none compiled (nor lowered): none can fit
                f"jax.checkpoint(block, policy={policy}) per block, which saves least, "
                f"predicted at {fmt_bytes(pred)}, over "
                f"{REWRITTEN_OVER * (1 + BUILTIN_SPREAD):.2f}x the budget"))
        if (compiled == 0 and not per_block and policy == "dots_saveable"
                and (pred := _whole_far(traced, step, error, miss))):
            return fits, lowest, (pred, (   # no blocks: neither whole-loss one can fit
                f"the step has no blocks, and jax.checkpoint(loss, policy=dots_saveable) is "
                f"predicted at {fmt_bytes(pred)}, over {WHOLE_OVER * (1 + WHOLE_SPREAD):.2f}x "
                "the budget"))
        try:
            lowered = traced.lower()
        except Exception:  # noqa: BLE001 - jax.checkpoint cannot take this loss
            continue
        exe = measure.compile(lowered)
        fig = read(exe, jitted, step.flat)
        compiled += 1
        lowest = min(lowest, fig.peak)
        if fig.peak <= error.requested_bytes:
            fits.append((fig.flops, fig.peak, policy, per_block, fig, exe))
        elif k == 0 and fig.peak > error.requested_bytes * (1 + BUILTIN_SPREAD):
            break  # the one that saves least is far above the budget: the others save more
        elif (compiled == 1 and not per_block
              and fig.peak > error.requested_bytes * (1 + WHOLE_SPREAD)):
            break  # no blocks: the other whole-loss built-in will not fit either
    return fits, lowest, None


def _first_far(peak: int | None, error: BudgetError, miss: float | None) -> int | None:
    """The peak the liveness model predicts for :data:`FIRST_BUILTIN`'s program
    (``peak``, :func:`first_builtin`'s; scaled by ``miss``, the smallest compiled over
    rewritten peak of the plans the search compiled, where that is under 1), where it is
    above the budget by more than :data:`REWRITTEN_OVER` times ``1 +``
    :data:`BUILTIN_SPREAD` and not below the lowest peak the search reached by more than
    :data:`MINIMUM_TOLERANCE`: it cannot fit, nor compile within the spread that lets
    the others be compiled, nor (as predicted) lower the error's minimum, so none is
    compiled (else None). The liveness model's peak of the built-ins per block was at
    most 18.7% above their compiled peak over the ``benchmarks.prediction --plans`` files
    (the zoo ResNet at test size, H100 target; ``dots_saveable``, 8.3% at bench size),
    but 1.52x on the lm1b-width GPT-2 decoder, as its block plan's rewritten step (1.47x,
    the miss that scales it there); around the whole loss up to 102% above, so a step
    without blocks is not predicted here.
    Transformers' ResNet18 (bench size, H100 target, budget 0.5): predicted 196.29 MiB,
    compiled to 183.38 against a budget of 104.18, after the search had reached 183.57
    (6.2 s of the 23.1 s that raised :class:`BudgetError`)."""
    if peak is None:   # not analysed: compiled as before
        return None
    pred = int(peak * min(1.0, miss or 1.0))
    far = REWRITTEN_OVER * (1 + BUILTIN_SPREAD) * error.requested_bytes
    return pred if pred > far and pred >= error.minimum_bytes * (1 - MINIMUM_TOLERANCE) else None


def _whole_far(traced: Any, step: Step, error: BudgetError, miss: float | None
               ) -> int | None:
    """The peak the liveness model predicts for ``jax.checkpoint(loss,
    policy=dots_saveable)``'s program (``traced``; scaled by ``miss`` where that is under
    1, as :func:`_first_far`), where even at :data:`WHOLE_OVER` below it it is above the
    budget by more than :data:`WHOLE_SPREAD`: it cannot fit, nor let ``nothing_saveable``
    around the whole loss be compiled (at most 14.2% below it); and where the error's
    minimum is a prediction (``BudgetError.minimum_predicted``: nothing was compiled only
    for it either) or not above that bound. None otherwise (compiled as before).
    Equinox's BatchNorm CNN (no blocks; bench size, H100 target, budget 0.5, 40.33 MiB):
    predicted 110.98 MiB, compiled to 80.79 (the search's minimum predicted 59.66)."""
    peak = _traced_peak(traced, step)
    if peak is None:
        return None
    pred = int(peak * min(1.0, miss or 1.0))
    bound = pred / WHOLE_OVER
    if bound <= (1 + WHOLE_SPREAD) * error.requested_bytes:
        return None
    if not error.minimum_predicted and bound < error.minimum_bytes * (1 - MINIMUM_TOLERANCE):
        return None   # it may lower a compiled minimum
    return pred


def unplanned_budget(plan: Plan, analysis: Analysis, step: Step, budget: Any,
                     fn: Any, planned: Any = None, bodies: Any = None
                     ) -> tuple[Plan, Any]:
    """A budget on a step with nothing to plan (no backward pass at the top level, or
    ``strategy="none"``): the plain step runs, so its compiled peak must fit, or
    ``BudgetError`` (a budget is a guarantee, never a hint). ``planned``: the step with
    its loop or shard_map bodies planned, which runs if its compiled peak fits; ``bodies``:
    the :class:`~jaxmem.compiling.shard_map.StepBudget` the ``shard_map`` bodies were
    planned for, whose plain step is compiled already and whose lowest peak, where a body's
    search missed, is the error's minimum when lower. ``fn``: the user's step (named in the
    error)."""
    flat = step.flat
    if bodies is not None:
        exe, base = bodies.compiled_plain()
    else:
        exe = measure.compile(step.plain.lower(*flat))
        base = read(exe, step.plain, flat)
    requested = resolve_budget(budget, base.peak)
    if planned is not None:  # bodies planned as steps of their own (loops, shard_map)
        planned_exe = measure.compile(planned.lower(*flat))
        fig = read(planned_exe, planned, flat)
        if fig.peak <= requested:
            how = ("by the budget search" if any("budget" in q.strategy for q in plan.inner)
                   else "without the budget")
            note = (f"bodies planned as steps of their own ({how}): the "
                    f"step's compiled peak {fmt_bytes(fig.peak)} fits the budget "
                    f"{fmt_bytes(requested)}")
            return dataclasses.replace(plan, budget=requested, notes=plan.notes + (note,),
                                       compiled=fig, baseline=base), planned_exe
        if base.peak > requested:
            searched = bodies.lowest if bodies is not None else None
            low = min(fig.peak, base.peak, searched or base.peak)
            budget_notes = tuple(n for q in plan.inner for n in q.notes if "budget" in n)
            raise BudgetError(
                f"jaxmem.optimize: {getattr(fn, '__name__', 'fn')}'s jax.grad is inside a "
                f"{'/'.join(backward_in_units(analysis.program)) or 'loop'} body, planned as "
                f"a step of its own "
                f"({'; '.join(plan.notes + budget_notes)}); the planned step compiles to "
                f"{fmt_bytes(fig.peak)} (plain {fmt_bytes(base.peak)}), above the budget "
                f"{fmt_bytes(requested)}. Raise the budget or use a smaller batch.",
                requested, low)
        plan = dataclasses.replace(plan, inner=())  # the plain step fits
    why = (why_unplanned(fn, analysis) if not analysis.program.has_backward
           else 'strategy="none" runs the plain step')
    if base.peak > requested:
        raise BudgetError(
            f"jaxmem.optimize: {why}, so nothing can be recomputed or offloaded, and the "
            f"plain step's compiled peak {fmt_bytes(base.peak)} is above the budget "
            f"{fmt_bytes(requested)}. Raise the budget, use a smaller batch, or put the "
            "memory-heavy part under jaxmem.checkpoint.", requested, base.peak)
    note = (f"{why}: the plain step's compiled peak {fmt_bytes(base.peak)} fits the budget "
            f"{fmt_bytes(requested)}")
    return dataclasses.replace(plan, budget=requested, notes=plan.notes + (note,),
                               compiled=base, baseline=base), exe


def why_unplanned(fn: Any, analysis: Analysis) -> str:
    """Why a step without a top-level backward pass gets no plan, for warnings and errors."""
    name = getattr(fn, "__name__", "fn")
    units = backward_in_units(analysis.program)
    if units:
        return (f"{name}'s jax.grad is inside a {'/'.join(units)} body, which the joint "
                "rewrite keeps whole (no backward pass at the top level to plan; to save "
                "memory there, wrap the loss inside the body in jaxmem.checkpoint)")
    return (f"{name} has no backward pass (no jax.grad inside, or no parameter reaches the "
            "loss)")
