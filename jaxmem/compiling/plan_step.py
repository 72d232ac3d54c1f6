"""Plan one signature of the step, compiling candidates on its target on the way.

Part of the fifth box (:mod:`jaxmem.compiling`). :func:`make_plan` starts from MEDL's auto
plan (:func:`first_plan`), then, by the options: a budget's scan-body policy that fits alone,
the budget search (:mod:`jaxmem.planning.budget`, its compiles from here; with the optimizer
state's offload weighed in, :mod:`jaxmem.memory.state_offload`) and its fallbacks to JAX's
built-in policies (:mod:`.builtin_fallbacks`), or the offload of tagged values. Without a
budget the plan is then verified against the plain step (:mod:`.choose`; a plan that
offloads, :mod:`.offload_verify`), or, with ``verify="background"``, the candidate the first
calls run is picked and its verification left to the caller (:mod:`.background`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.liveness import liveness
from jaxmem.analyzing.losses import logits_notes
from jaxmem.analyzing.tags import offload_tagged
from jaxmem.compiling import background, choose, plan_cache, predicted
from jaxmem.compiling.background import first_to_run
from jaxmem.compiling.builtin_fallbacks import (
    builtin_within,
    candidates_within,
    first_builtin,
    unplanned_budget,
    why_unplanned,
)
from jaxmem.compiling.offload_verify import device_peak, verified_offload
from jaxmem.compiling.options import Options
from jaxmem.compiling.signature import profile_of
from jaxmem.compiling.steps import (
    Step,
    equations,
    program_equations,
    read,
    rewrite_key,
    too_large,
    too_many,
    within_growth,
)
from jaxmem.compiling.trace_step import scans
from jaxmem.memory import state_offload
from jaxmem.planning import strategies
from jaxmem.planning.budget import BudgetError, plan_with_budget
from jaxmem.planning.budget.fallbacks import block_variants
from jaxmem.planning.budget.units import TooLargeToCompile
from jaxmem.planning.costs import step_costs
from jaxmem.planning.plan import Plan
from jaxmem.rewriting.scans import loop_plan
from jaxmem.tracing.program import from_jaxpr
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import Figures


class Made(NamedTuple):
    """A plan made for one signature."""

    plan: Plan
    compiled: Any  # the plan's executable when one was compiled on the way (else None)
    # The optimizer state's groups in flight while it streams from host memory
    # (jaxmem.memory.state_offload.stream); 0: it stays on the device.
    stream_state: int
    # Whether ``compiled`` is the step with its state streamed (the budget search compiled
    # and checked it so), not the plan's step alone.
    streamed: bool = False


class _Compiles:
    """The budget search's compiles of one step; the plain step compiled once however
    often it is asked for. The executables of the plans no other compiled plan beats on
    both peak and FLOPs are kept (the chosen plan's runs the first call); a plan beaten on
    both is not the search's answer, and its executable is let go as soon as it is, so
    planning holds a few executables, not one per compile (issue 37). Should the search
    still choose one, it is compiled again for the first call (:meth:`exe_for` gives
    None)."""

    def __init__(self, step: Step,
                 stream: Callable[[Any], tuple[Any, list[Any]]] | None = None) -> None:
        self.step = step
        # stream(jitted) -> (jitted step with its state streamed from host memory, the
        # arguments to lower it with): every program is compiled so, the plain step too
        self.stream = stream
        self.kept: dict[Any, tuple[Any, Figures]] = {}  # rewrite key -> (executable, figures)
        self._plain: tuple[Any, Figures] | None = None
        # (rewrite key, traced) of the last plan :meth:`rewritten` traced: compiled without
        # tracing it again when the search picks it (one held, not one per plan)
        self._traced: tuple[Any, Any] | None = None
        self._peaks: dict[Any, int | None] = {}   # rewrite key -> :meth:`rewritten`'s figure
        self._misses: list[float] = []   # compiled over rewritten peak, of each plan compiled
        self._too_large: dict[Any, str] = {}   # rewrite key -> why (:meth:`rewritten` saw)
        # the plain step compiling in a thread (:meth:`start_plain`): (jitted, arguments,
        # future of its executable)
        self._plain_ahead: tuple[Any, list[Any], concurrent.futures.Future] | None = None
        # Python the search will ask for, run while a plan compiles (:meth:`beside`)
        self._pending: list[Callable[[], Any]] = []
        self._left: list[Plan] = []   # of :meth:`warm`'s plans, those not analysed in it

    def _streamed(self, jitted: Any) -> tuple[Any, list[Any]]:
        return self.stream(jitted) if self.stream else (jitted, self.step.flat)

    def plan(self, p: Plan) -> Figures:
        key = rewrite_key(p)
        if key in self._too_large:   # sized by its rewritten step: not traced again
            raise TooLargeToCompile(self._too_large[key])
        jitted, flat = self._streamed(self.step.rewrite(p))
        if self._traced is not None and self._traced[0] == key:
            traced = self._traced[1]
        else:
            traced = jitted.trace(*flat)
        self._traced = None
        # sized first: the search's own plans (greedy, exact) and MEDL's, which replays
        # chains region by region (3.3x the step on the lm1b-width GPT-2 decoder)
        _check_size(traced.jaxpr, len(self.step.program.nodes))
        exe = self._compile(traced.lower())
        fig = read(exe, jitted, flat)
        if self._peaks.get(key):
            self._misses.append(fig.peak / self._peaks[key])
        others = {k: f for k, (_, f) in self.kept.items() if k != key}
        if not any(_beats(f, fig) for f in others.values()):
            self.kept = {k: v for k, v in self.kept.items() if not _beats(fig, v[1])}
            self.kept[key] = (exe, fig)
        return fig

    def beside(self, task: Callable[[], Any]) -> None:
        """Run ``task`` (Python the search may need, memoised where it is read: one that
        raises is redone there) while a plan compiles, in the order given: XLA's compile
        does not hold the GIL, and one compile keeps 1.35 to 1.69 of two CPUs busy
        (``benchmarks.compile_cores``), so Python beside it costs little of its time."""
        self._pending.append(task)

    def _compile(self, lowered: Any) -> Any:
        """``lowered`` compiled, the pending tasks (:meth:`beside`) run while it is."""
        if not self._pending:
            return measure.compile(lowered)
        future = _compiling(lowered, "jaxmem-compile")
        while self._pending and not future.done():
            task = self._pending.pop(0)
            # work ahead of its need: one that raises is redone where it is read
            with contextlib.suppress(Exception):
                task()
        return future.result()

    def rewritten(self, p: Plan) -> int | None:
        """The peak the liveness model predicts for ``p``'s rewritten step, as compiled
        here (streamed where it streams); None where it cannot be traced (the compile will
        say why)."""
        key = rewrite_key(p)
        if key not in self._peaks:
            self._peaks[key] = self._rewritten(key, p)
        return self._peaks[key]

    def rewritten_miss(self) -> float | None:
        """The smallest compiled over rewritten peak (:meth:`rewritten`) of the plans
        compiled so far whose rewritten step was predicted; None before any."""
        return min(self._misses, default=None)

    def _rewritten(self, key: Any, p: Plan) -> int | None:
        of = len(self.step.program.nodes)
        try:
            if self.stream:   # the streamed step is traced (its wrapper is not a rewrite)
                jitted, flat = self._streamed(self.step.rewrite(p))
                traced = jitted.trace(*flat)
                self._traced = (key, traced)   # plan() sizes it without a new trace
                program = from_jaxpr(traced.jaxpr)
                n = equations(traced.jaxpr)
            else:   # built without a trace (jaxmem.rewriting.symbolic): the same nodes
                program, why = within_growth(lambda limit: self.step.rewritten(p, limit), of)
                if program is None:   # not built past the growth limit
                    self._too_large[key] = why
                    return None
                n = program_equations(program)
            why = too_many(n, of)
            if why is not None:
                self._too_large[key] = why
                return None     # not compiled either (plan() says why)
            return liveness(program, donated=self.step.donate_flat,
                            platform=self.step.platform)[0]
        except Exception:  # noqa: BLE001 - an ordering hint only: the plan is compiled as before
            return None

    def start_plain(self) -> None:
        """Start the plain step's compile in a thread (:meth:`plain` waits for it), so that
        the caller's Python runs beside it (XLA's compile does not hold the GIL)."""
        if self._plain is None and self._plain_ahead is None:
            plain, flat = self._streamed(self.step.plain)
            self._plain_ahead = (plain, flat, _compiling(plain.lower(*flat), "jaxmem-plain"))

    def warm(self, plans: list[Plan]) -> int:
        """The rewritten steps' predicted peaks of ``plans`` (:meth:`rewritten`, kept for
        the search), in order, while the plain step compiles (started here); those left
        when it is compiled are analysed when the search asks, or beside its compile for
        the lowest peak (:meth:`analyse_left`). How many were analysed while the plain
        step compiled."""
        self.start_plain()
        n = 0
        for p in plans:
            if self._plain_ahead is None or self._plain_ahead[2].done():
                break
            self.rewritten(p)
            n += 1
        self._left = plans[n:]
        return n

    def analyse_left(self) -> None:
        """:meth:`warm`'s plans not analysed yet, beside the next compile (:meth:`beside`):
        for a search that cannot fit (the automatic mode's candidates are ranked by their
        rewritten steps after it); a search that fits would not read most of them, and
        Python beside a compile slows it a little."""
        for p in self._left:
            self.beside(functools.partial(self.rewritten, p))
        self._left = []

    def plain(self) -> Figures:
        # The plain step is the same program however often a search asks: compiled once
        # (the state-offload path runs up to two searches and reads the plain peak too).
        if self._plain is None:
            if self._plain_ahead is not None:
                plain, flat, future = self._plain_ahead
                self._plain_ahead = None
                exe = future.result()
            else:
                plain, flat = self._streamed(self.step.plain)
                exe = measure.compile(plain.lower(*flat))
            self._plain = (exe, read(exe, plain, flat))
        return self._plain[1]

    def seed_plain(self, kept: Any) -> None:
        """Take ``kept`` (a :class:`~jaxmem.compiling.scan_budget.Kept` with its
        executable) as the plain step's compile, where the plain step, not streamed, lowers
        to that very program."""
        if (kept is not None and kept.executable is not None and self.stream is None
                and self._plain is None and kept.same(self.step.plain, self.step.flat)):
            self._plain = (kept.executable, kept.figures)

    def exe_for(self, p: Plan) -> Any:
        """The executable compiled for ``p`` (the plain step's when it drops nothing)."""
        if p.recompute or p.offload:
            return self.kept.get(rewrite_key(p), (None,))[0]
        return self._plain[0] if self._plain is not None else None


def _compiling(lowered: Any, name: str) -> concurrent.futures.Future:
    """``lowered``'s compile started in a thread of its own (named ``name``): the
    caller's Python runs beside it (XLA's compile does not hold the GIL)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(measure.compile, lowered)
    pool.shutdown(wait=False)
    return future


def _check_size(jaxpr: Any, step_equations: int) -> None:
    """Raise :class:`TooLargeToCompile` when ``jaxpr`` (a rewrite, sub-jaxprs counted)
    has more than :data:`~jaxmem.compiling.steps.MAX_REWRITE_GROWTH` times
    ``step_equations`` (:func:`~jaxmem.compiling.steps.too_large`)."""
    why = too_large(jaxpr, step_equations)
    if why is not None:
        raise TooLargeToCompile(why)


def _beats(a: Figures, b: Figures) -> bool:
    """Whether ``a`` is at or below ``b`` on both peak and FLOPs, and below on one."""
    return a.peak <= b.peak and a.flops <= b.flops and (a.peak, a.flops) != (b.peak, b.flops)


def first_plan(analysis: Analysis, options: Options, fn: Any,
               warn: Callable[[str], None], loop_plans: tuple[Any, ...] = ()) -> Plan:
    """MEDL's auto plan, or keep everything (``strategy="none"``, no backward pass); a
    step whose only backward passes are in loop bodies runs their ``loop_plans``.
    ``warn``: says, once per ``optimize``, that a step without a backward runs as plain."""
    if not analysis.program.has_backward and loop_plans:
        return loop_plan(analysis, loop_plans)
    if not analysis.program.has_backward:
        warn(f"jaxmem.optimize: {why_unplanned(fn, analysis)}; running it as a plain "
             "jax.jit.")
        return strategies.plan_none(analysis)
    if options.strategy == "none":
        return strategies.plan_none(analysis)
    return strategies.plan_auto(analysis,
                                max_recompute_fraction=options.max_recompute_fraction)


def make_plan(options: Options, analysis: Analysis, step: Step, *, fn: Any,
              warn: Callable[[str], None], body: Any = None,
              loop_plans: tuple[Any, ...] = (), defer: bool = False,
              bodies_budget: Any = None) -> Made:
    """Plan the step (compiling candidates on its target); the chosen plan's executable
    when one was compiled on the way; whether the optimizer state streams from host
    memory (``offload_state``). ``loop_plans``: the plans of loop and shard_map bodies
    planned as steps of their own (:mod:`.trace_step`). ``body``: a budget's scan-body
    choice (:mod:`.scan_budget`). ``defer``: leave the candidates' verifying compiles to
    the caller (``verify="background"``). ``fn``, ``warn``: for :func:`first_plan`.
    ``bodies_budget``: the budget the ``shard_map`` bodies were planned for
    (:attr:`jaxmem.compiling.trace_step.Traced.bodies_budget`)."""
    donated, compiled, streamed = step.donated, None, False
    plan = dataclasses.replace(first_plan(analysis, options, fn, warn, loop_plans),
                               donated=donated)
    planning = analysis.program.has_backward and options.strategy != "none"
    # "auto": only where a budget needs it (state_offload.with_budget decides)
    stream_state = (state_offload.WINDOW if options.offload_state is not False
                    and options.offload_state != "auto" else 0)
    if planning and body is not None and body.fits:
        # The body policy fits with no recompute outside the scan (compiled so).
        plan = dataclasses.replace(
            strategies.plan_auto(analysis, max_recompute_fraction=0.0), donated=donated,
            strategy="budget: scan body", budget=body.budget, notes=body.notes)
    elif planning and options.budget is not None:
        plan, compiled, stream_state = _within_budget(options, analysis, step, plan, body)
        streamed = bool(stream_state) and compiled is not None
    elif planning and (options.offload is True or offload_tagged(analysis)):
        # No budget: values tagged with jaxmem.offload_name are offloaded; offload=True
        # also offloads kept residuals whose round trip hides under compute.
        plan = strategies.plan_offload(analysis, plan, offload=options.offload)
        plan = dataclasses.replace(plan, donated=donated)
    if options.budget is not None and not planning:
        plan, compiled = unplanned_budget(plan, analysis, step, options.budget, fn,
                                          step.rewrite(plan) if plan.inner else None,
                                          bodies_budget)
    plan = dataclasses.replace(plan, notes=plan.notes + logits_notes(analysis))
    if options.verify and options.budget is None and (plan.offload or plan.recompute
                                                      or plan.inner):
        plan, compiled = _verify(options, analysis, step, plan, compiled, defer)
    if plan.recompute or plan.offload:  # the printout's predicted cost of each mechanism
        plan = dataclasses.replace(plan, costs=step_costs(
            analysis, plan, profile_of(step.flat),
            scan_bodies=bool(options.remat_scans) and scans(step.program.jaxpr.jaxpr)))
    return Made(plan, compiled, stream_state, streamed)


def _within_budget(options: Options, analysis: Analysis, step: Step, auto: Plan,
                   body: Any) -> tuple[Plan, Any, int]:
    """The budget search from ``auto`` (the state's offload weighed in where asked), the
    executable it compiled for its plan (with the state streamed where it streams), and
    the state's groups in flight (0: it stays on the device); when the search cannot meet
    the budget, JAX's built-in policies (never with state offload)."""
    program, flat = analysis.program, step.flat
    info = options.offload_state and state_offload.preview(
        program, step.args, options.offload_state, flat)
    compiles = {0: _Compiles(step)}  # by the state's groups in flight (0: not streamed)
    # the plain step the scan-body search compiled (the same program): not compiled again
    compiles[0].seed_plain(getattr(body, "plain", None))
    profile = _budget_profile(options.budget, flat)
    cands: list[Plan] | None = None   # the automatic mode's, where analysed while warm
    builtin = _FirstBuiltin(compiles[0], step)
    if options.offload_state is False and _ranked(options.budget):
        # the block plans' rewritten steps (the ranked search's predictor) do not depend on
        # the budget's bytes: analysed while the plain step compiles, fewest FLOPs first
        # (the search's order among those that fit); warm starts the plain compile
        # (MEDL's plan first: the search's first compile, unless its rewritten step rules
        # it out; the automatic mode's candidates last: candidates_within ranks them where
        # the search misses)
        cands = strategies.auto_candidates(
            analysis, max_recompute_fraction=options.max_recompute_fraction)
        compiles[0].warm(([auto] if auto is not None and auto.recompute else [])
                         + [p for _, p in sorted(block_variants(analysis),
                                                 key=lambda t: t[1].recompute_flops)]
                         + cands)

    def search(budget: Any, window: int) -> Plan:
        if window not in compiles:
            # a streamed search with fewer groups in flight replaces one with more; the
            # step as traced keeps its compiles (its plan may still be the one that runs)
            for w in [w for w in compiles if w]:
                del compiles[w]
            compiles[window] = _Compiles(step, _streamer(options, step, window))
        c = compiles[window]
        # The streamed step's state is in host memory: its compiled peaks are searched
        # against the budget as if that state were on the device (each peak plus its bytes),
        # which is how the cost model, fed the step as traced, counts them.
        shift = info.nbytes if window else 0
        try:
            return plan_with_budget(
                analysis, budget + shift if shift else budget, auto=auto,
                compile_plan=plan_cache.progress(_shifted(c.plan, shift), "budget search"),
                compile_plain=plan_cache.progress(_shifted(c.plain, shift), "budget search"),
                device_peak=lambda p, fig: device_peak(program, p, fig, step.platform),
                offload=options.offload, profile=profile, rewritten=c.rewritten,
                rewritten_miss=c.rewritten_miss, failing=None if window else builtin.failing)
        except BudgetError as e:
            if not shift:
                raise
            low = e.minimum_bytes - shift
            raise BudgetError(
                f"no plan fits the budget {measure.fmt_bytes(budget)} with the optimizer "
                f"state streamed from host memory ({window} group(s) in flight): the lowest "
                f"{'predicted' if e.minimum_predicted else 'compiled'} peak jaxmem reached "
                f"is {measure.fmt_bytes(low)}. Try a smaller batch or a larger budget.",
                budget, low, minimum_predicted=e.minimum_predicted) from e

    try:
        plan, stream_state = state_offload.with_budget(
            search, options.budget, options.offload_state, info,
            lambda: compiles[0].plain().peak, profile_of(flat))
    except BudgetError as e:
        if options.offload_state is not False:
            raise
        found, e = candidates_within(e, analysis, step, options, compiles[0], cands)
        if found is not None:
            return (*found, 0)
        plan, compiled = builtin_within(e, analysis, step, compiles[0].plain,
                                        compiles[0].rewritten_miss(), builtin.made)
        return plan, compiled, 0
    plan = dataclasses.replace(plan, donated=step.donated,
                               notes=plan.notes + (body.notes if body else ()))
    # the executable the search compiled for the chosen plan runs the first call
    return plan, compiles[stream_state].exe_for(plan), stream_state


class _FirstBuiltin:
    """:func:`~jaxmem.compiling.builtin_fallbacks.first_builtin` of ``step``, made beside
    the compile the budget search spends on its lowest peak (:meth:`failing`, its
    ``failing`` callback), once, after the plans left from ``_Compiles.warm``: what the
    fallbacks read after a :class:`BudgetError`. A search that fits makes neither."""

    def __init__(self, compiles: _Compiles, step: Step) -> None:
        self.compiles, self.step = compiles, step
        self.made: Any = None
        self.queued = False

    def failing(self) -> None:
        if not self.queued:
            self.queued = True
            self.compiles.analyse_left()
            self.compiles.beside(self._make)

    def _make(self) -> None:
        self.made = first_builtin(self.step)


def _ranked(budget: Any) -> bool:
    """Whether ``budget`` searches the ranked way (a :class:`Budget` may ask otherwise)."""
    return getattr(budget, "search", "ranked") == "ranked"


def _budget_profile(budget: Any, flat: Any) -> Any:
    """The device profile the budget search weighs recompute and transfers on: the
    :class:`~jaxmem.planning.budget.Budget`'s own, else that of the target the arguments are
    compiled for (an H100 topology's, not the machine planning it), else None (detected)."""
    given = getattr(budget, "profile", None)
    if given is not None:
        return given
    try:
        target = targets.of(flat)
    except Exception:  # noqa: BLE001 - no target to name: the search detects the device
        return None
    return target.profile if target.name != "unknown" else None


def _shifted(compile_fn: Callable[..., Figures], shift: int) -> Callable[..., Figures]:
    """``compile_fn`` with ``shift`` bytes added to each peak it reports (counted as
    arguments: the state's bytes, as if on the device)."""
    if not shift:
        return compile_fn
    return lambda *a: dataclasses.replace(f := compile_fn(*a), argument=f.argument + shift)


def _streamer(options: Options, step: Step, window: int
              ) -> Callable[[Any], tuple[Any, list[Any]]]:
    """``jitted -> (jitted with the state streamed, window groups in flight; the abstract
    arguments to lower it with, the state's in pinned_host memory)``: what runs, as
    :func:`jaxmem.compiling.build._runnable` builds it."""
    abstract = background.stand_ins(list(step.flat))  # placing them moves no user array

    def stream(jitted: Any) -> tuple[Any, list[Any]]:
        wrapped, info = step.streamed(jitted, options.offload_state, window)
        return wrapped, state_offload.place(abstract, info.inputs if info else ())
    return stream


def _verify(options: Options, analysis: Analysis, step: Step, plan: Plan, compiled: Any,
            defer: bool) -> tuple[Plan, Any]:
    """``verify`` without a budget: the candidates against the plain step (a plan that
    offloads: with and without its recompute); ``defer``: only the plan the first calls
    run, the candidate that drops the most (fewest FLOPs)."""
    if plan.offload:
        return verified_offload(plan, analysis, step, options.offload)
    if plan.inner and not plan.recompute:  # planned inside loop / shard_map bodies
        return choose.verified_as_is(plan, analysis, step)
    if options.verify is True or options.verify == "predicted":
        return predicted.predicted(plan, analysis, step, options)
    if not defer:
        return choose.verified(plan, analysis, step, options)
    return first_to_run(plan, strategies.auto_candidates(
        analysis, max_recompute_fraction=options.max_recompute_fraction),
        logits_notes(analysis)), compiled
