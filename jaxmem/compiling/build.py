"""One signature of the step built: traced, planned, jitted; the cache entry it runs from.

Part of the fifth box (:mod:`jaxmem.compiling`): what :class:`~jaxmem.optimized.Optimized`
does on a cache miss. :func:`build` traces the step (:mod:`.trace_step`), analyses it,
decides the donation (:mod:`.donation`), takes the plan from the plan cache
(:mod:`.plan_cache`) or makes it (:mod:`.plan_step`), jits the program that runs it
(the plain step where a budget drops nothing; the optimizer state streamed from host
memory where asked, :mod:`jaxmem.memory.state_offload`), and returns the
:class:`~jaxmem.compiling.entry.Entry`; with ``verify="background"`` the verification is
scheduled on it (:mod:`.background`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jaxmem.analyzing.analysis import Analysis, from_program
from jaxmem.compiling import background, choose, donation, plan_cache, predicted, steps
from jaxmem.compiling.entry import Entry
from jaxmem.compiling.offload_verify import check_offload
from jaxmem.compiling.options import Options
from jaxmem.compiling.plan_step import Made, make_plan
from jaxmem.compiling.signature import Signature, bind, device_kind, profile_of
from jaxmem.compiling.signature import shardings as shardings_of
from jaxmem.compiling.trace_step import Traced, trace_step
from jaxmem.memory import state_offload
from jaxmem.planning.plan import Plan
from jaxmem.tracing.program import flat_donated
from jaxmem.xla import targets


def build(opt: Any, options: Options, fn: Callable[..., Any], args: tuple[Any, ...],
          sig: Signature, warn: Callable[[str], None]) -> Entry:
    """The cache entry of ``fn`` on the signature ``sig`` of a call with positional
    ``args``. ``opt``: the ``Optimized`` being built (body policies compile through it,
    :mod:`.trace_step`); ``warn``: its once-only warning for a step with no backward."""
    bound = bind(fn, args, sig.static, sig.static_kw, sig.leaf_static)
    traced, analysis, step, not_donated = _traced_step(opt, options, bound, sig)
    planning = step.program.has_backward and options.strategy != "none"
    # The plan cache holds plans; a step that streams its state from host memory decides
    # that per call of the budget search, so it is planned afresh.
    key = _plan_key(options, step) if planning and options.offload_state is False else None
    cached = plan_cache.load(key) if key else None
    # verify="background": the first call runs one unverified candidate; the others
    # compile in a thread beside the next calls (single process only: hosts must run
    # the same program at every step; and only where the thread traces the same way).
    defer = background.can_defer(options, planning, cached)
    deferred, first = False, None
    if cached is not None:  # made before (this process, or the disk cache): no compiles
        made = Made(dataclasses.replace(cached, donated=step.donated), None, 0)
    else:
        made = make_plan(options, analysis, step, fn=fn, warn=warn, body=traced.body,
                         loop_plans=traced.loop_plans, defer=defer,
                         bodies_budget=traced.bodies_budget)
        deferred = defer and bool(made.plan.recompute) and not made.plan.offload
        first = made.plan  # the plan the verification starts from (its donation, notes)
        made = made._replace(plan=_noted(made.plan, traced.lean_notes + not_donated,
                                         deferred))
    jitted, plan, compiled, host_state = _runnable(options, step, traced, made)
    if key and cached is None and not deferred:
        # cached as it runs: with the figures of an executable the scan-body search compiled
        # (_runnable), so that a hit's report needs no compile either
        plan_cache.store(key, plan)
    entry = Entry(analysis=analysis, plan=plan, jitted=jitted, donate_flat=step.donate_flat,
                  plain=step.plain, compiled=compiled, static_out=bound.static_out,
                  host_state=host_state, cache_key=None if deferred else key)
    if deferred:
        # the first plan's bar: verify=True's predicted check, the step's predicted plain
        # peak less the model's error bound (0 where verify=True would compile the plain
        # step: a platform without a bound, a step under PLAIN_MIN_BYTES; it verifies first)
        background.schedule(entry, step,
                            lambda on: choose.verified(first, analysis, on, options),
                            key, traced.lean_notes + not_donated,
                            predicted.plain_bar(analysis.peak_bytes, step.platform))
    return entry


def _traced_step(opt: Any, options: Options, fn: Callable[..., Any],
                 sig: Signature) -> tuple[Traced, Analysis, steps.Step, tuple[str, ...]]:
    """The step traced and analysed, offload checked, its donation decided (and the notes
    that say why an argument is not donated)."""
    traced = trace_step(opt, options, fn, sig.dyn_args, sig.kwargs)
    flat = jax.tree_util.tree_leaves((sig.dyn_args, sig.kwargs))
    platform = targets.platform_of(flat) or jax.default_backend()
    donated = donation.decide(options.donate_argnums, sig.dyn_args, traced.program)
    donate_flat = flat_donated(sig.dyn_args, donated.argnums)
    # the cost model predicts for the compiler the step is compiled by, with its donation
    # (the plain step's predicted peak is what verify=True checks plans against)
    analysis = from_program(traced.program, donated=donate_flat, platform=platform)
    check_offload(analysis, flat, platform, options.offload)
    step = steps.make(traced.program, fn, (sig.dyn_args, sig.kwargs), donated.argnums,
                      donate_flat, options.jit_kwargs)
    return traced, analysis, step, donated.notes


def _plan_key(options: Options, step: steps.Step) -> str:
    """The plan cache's key: the program, the target, the options."""
    return plan_cache.fingerprint(step.program.jaxpr,
                                  (step.platform, device_kind(step.flat),
                                   shardings_of(step.flat)),
                                  options.cache_key(step.donate_flat))


def _noted(plan: Plan, lean_notes: tuple[str, ...], deferred: bool) -> Plan:
    """``plan`` with the scan-body choice's notes, and the pending verification's."""
    plan = dataclasses.replace(plan, notes=plan.notes + lean_notes)
    if deferred:
        plan = dataclasses.replace(plan, notes=plan.notes + (background.NOT_VERIFIED,))
    return plan


def _runnable(options: Options, step: steps.Step, traced: Traced,
              made: Made) -> tuple[Any, Plan, Any, tuple[int, ...]]:
    """The jitted step that runs the plan, the plan, its executable (None: compile on
    the first call), and the flat argument positions kept in host memory."""
    plan, compiled = made.plan, made.compiled
    # A budget the plain step already fits drops nothing: run the plain step itself (its
    # figures are the ones the budget was checked against).
    nothing = (options.budget is not None and not (plan.recompute or plan.offload)
               and traced.body is None and not plan.inner and not plan.loss_policy)
    jitted = step.plain if nothing else step.running(plan, traced.body)
    if not made.stream_state:
        if compiled is None:
            compiled, plan = _body_executable(jitted, step.flat, traced.body, plan)
        return jitted, plan, compiled, ()
    jitted, info = step.streamed(jitted, options.offload_state, made.stream_state)
    if info is None:
        return jitted, plan, compiled, ()
    plan = dataclasses.replace(plan, state_offload=info, compiled=None,
                               notes=plan.notes + (info.describe(profile_of(step.flat)),))
    streamed = None
    if made.streamed:  # the budget search compiled this step, streamed, within the budget
        streamed = compiled
    elif plan.budget is not None:
        streamed = _streamed_within(jitted, step.flat, info, plan.budget)
    return jitted, plan, streamed, info.inputs


def _body_executable(jitted: Any, flat: Any, body: Any, plan: Plan) -> tuple[Any, Plan]:
    """The executable a budget's scan-body search compiled for the policy that fits alone
    (:func:`jaxmem.compiling.scan_budget.choose_for`), and ``plan`` with its figures and
    the plain step's, where ``jitted`` lowers to that very program; else ``(None, plan)``
    (the first call compiles it)."""
    kept = getattr(body, "executable", None)
    if kept is None or not kept.same(jitted, flat):
        return None, plan
    return kept.executable, plan.with_figures(kept.figures, body.plain and body.plain.figures)


def _streamed_within(jitted: Any, flat: Any, info: Any, budget: int) -> Any:
    """The step with its state streamed from host memory, compiled and checked against the
    budget, where the budget search did not compile it so (a scan-body policy that fits
    alone, its executable let go): a plan found for the step as traced need not fit once
    streamed, as XLA schedules it (1B Llama, 184 sequences: planned against 86.30 GiB with
    an estimated 7.21 GiB freed, compiled to 80.60 GiB over a 79.10 GiB budget). The
    executable is the one the first call runs."""
    from jaxmem.planning.budget.units import BudgetError
    from jaxmem.xla import measure

    abstract = background.stand_ins(list(flat))  # placing them moves no user array
    exe = measure.compile(jitted.lower(*state_offload.place(abstract, info.inputs)))
    peak = measure.figures(exe).peak
    if peak > budget:
        raise BudgetError(
            f"no plan fits the budget {measure.fmt_bytes(budget)}: with the optimizer state "
            f"streamed from host memory the step compiles to {measure.fmt_bytes(peak)} (its "
            "residuals were planned against the budget plus an estimate of the device bytes "
            "the state frees, which the compiled schedule did not give back). Try a smaller "
            "batch or a larger budget.", budget, peak)
    return exe
