"""The choice among compiled candidates: never above plain ``jax.jit``, nor the built-in.

Part of the fifth box (:mod:`jaxmem.compiling`): ``verify="builtins"`` and ``"all"`` for
the automatic mode (no budget, no offload; ``verify=True`` is :mod:`.predicted`).
:func:`verified` compiles, side by side and for their figures only
(:mod:`.quick_compile`), the plain step, the rewrite of each candidate plan
(:func:`rewrite_candidates`) and the user's step with its loss under the built-in policy
:data:`LOSS_POLICY`, around the whole loss and around each block
(:func:`builtin_candidates`), on the arguments' target; it keeps the lowest compiled peak
(:func:`jaxmem.xla.measure.lowest`: peaks within ``PEAK_TIE``, the fewest FLOPs) and
compiles that one in full to run. When no candidate compiles below the plain step, the
plain step runs, with a warning and a note.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxmem.analyzing.analysis import Analysis
from jaxmem.analyzing.costmodel import CostModel
from jaxmem.analyzing.liveness import liveness
from jaxmem.compiling import quick_compile
from jaxmem.compiling.background import cancellable
from jaxmem.compiling.options import Options
from jaxmem.compiling.steps import Step, program_equations, read, too_many
from jaxmem.planning import lower_peaks, strategies
from jaxmem.planning.plan import Plan
from jaxmem.rewriting.scans import bodies_only
from jaxmem.tracing.program import Program, from_jaxpr
from jaxmem.xla.measure import PEAK_TIE, Figures, fmt_bytes, lowest

#: The built-in policy the automatic mode compiles as a candidate of its own, on the whole
#: loss: what users of every JAX library can do without editing the model.
LOSS_POLICY = "dots_saveable"


class Candidate(NamedTuple):
    """A plan, the jitted step that runs it, and a thunk that lowers that step;
    ``rewrites``: ``jitted`` is the step's rewrite of ``plan`` (:meth:`Step.rewrite`), whose
    program the analysis builds without tracing it (:meth:`Step.rewritten`)."""

    plan: Plan
    jitted: Any
    lower: Callable[[], Any]
    rewrites: bool = False


class Compiled(NamedTuple):
    """A candidate compiled for its figures: its lowering and its (figures-only) executable."""

    candidate: Candidate
    figures: Figures
    lowered: Any
    exe: Any


def verified(plan: Plan, analysis: Analysis, step: Step, options: Options) -> tuple[Plan, Any]:
    """Compile the auto strategy's best-predicted candidates, the built-ins and the plain
    step on the arguments' target; keep the lowest peak, and return its executable with it
    (the first call runs it instead of compiling again).

    The candidates (:func:`jaxmem.planning.strategies.auto_candidates`) drop the same kind of
    values but group their re-creation differently (per layer, per block, per block
    with every cheap value): which one XLA keeps least of depends on the compiler, so
    the compiler the step is for decides. Only the :data:`TOP` with the lowest peaks the
    cost model predicts are compiled first (:func:`ranked`; ``verify="all"`` compiles every
    one), with the one whose rewritten step's liveness is predicted lowest
    (:func:`with_rewritten_best`); the others only if none of those compiles below the
    plain step.
    Two more candidates are the built-in policy itself, always compiled: the step traced
    with its loss differentiated under ``jax.checkpoint(policy=dots_saveable)``
    (:meth:`Step.loss`), what a user does without editing the model, and the same around
    each block of the loss (blocks from the name stack, :mod:`jaxmem.rewriting.blockwise`:
    what ``nn.remat`` around every block does); so the automatic plan is never above them
    on the step's compiler.
    If none beats the plain step's compiled peak, the plain step is kept, with a warning
    and a note in the plan.
    """
    cands = rewrite_candidates(plan, analysis, step, options)
    builtins, skipped = builtin_candidates(analysis, step, plan.donated)
    if options.verify != "all":  # "all" compiles every candidate, whatever its size
        cands, too_big = sized(cands, step)
        skipped = too_big + skipped
    first, rest = (cands, []) if options.verify == "all" else ranked(cands, analysis)
    first, rest = with_rewritten_best(first, rest, step, analysis.platform)
    base, compiled = compile_candidates(step, first + builtins)
    cap = options.max_recompute_fraction
    compiled, over = within_cap(compiled, base.figures, cap)
    if rest and not any(c.figures.peak < base.figures.peak for c in compiled):
        more, more_over = within_cap(compile_more(step, rest), base.figures, cap)
        compiled, over = compiled + more, over + more_over
        first, rest = first + rest, []
    label = dict(zip(map(id, cands + builtins), _named(cands + builtins), strict=True))
    skipped += over + _not_compiled([label[id(c)] for c in rest], len(cands))
    if not compiled:
        return _hinted(_plain_kept(plan, analysis, None, base, skipped), analysis, cap)
    best = compiled[lowest([c.figures for c in compiled])]
    if best.figures.peak < base.figures.peak:
        return _hinted(_kept(best, base.figures, [label[id(c)] for c in first + builtins],
                             skipped, step), analysis, cap)
    return _hinted(_plain_kept(plan, analysis, best.figures, base, skipped), analysis, cap)


def sized(cands: list[Candidate], step: Step) -> tuple[list[Candidate], tuple[str, ...]]:
    """``cands`` less those whose rewrite has more than
    :data:`~jaxmem.compiling.steps.MAX_REWRITE_GROWTH` times the step's equations
    (:func:`~jaxmem.compiling.steps.too_large`: not worth their compile time and host
    memory), and a note naming each one left out. A candidate that cannot be traced here
    stays in (its compile says why)."""
    keep: list[Candidate] = []
    notes: list[str] = []
    for c in cands:
        why = rewrite_too_large(c, step)
        if why is None:
            keep.append(c)
        else:
            notes.append(f"{c.plan.strategy} not compiled: {why}")
    return keep, tuple(notes)


def rewrite_too_large(cand: Candidate, step: Step, program: Program | None = None
                      ) -> str | None:
    """Why ``cand``'s rewrite of ``step`` is too large to compile
    (:func:`~jaxmem.compiling.steps.too_large`, on its program, :func:`rewritten_program`
    or ``program`` where given); None when it is not, or when it cannot be traced here (its
    compile says why)."""
    return rewrite_size(cand, step, program)[0]


def rewrite_size(cand: Candidate, step: Step, program: Program | None = None
                 ) -> tuple[str | None, float]:
    """:func:`rewrite_too_large`, and the rewrite's equations over ``step``'s (0.0 where
    they cannot be counted here), from one count of its program's equations."""
    try:
        program = rewritten_program(cand, step) if program is None else program
        n, of = program_equations(program), len(step.program.nodes)
    except Exception:  # noqa: BLE001 - compiled as before; the compile says why
        return None, 0.0
    return too_many(n, of), n / max(of, 1)


def rewritten_program(cand: Candidate, step: Step, limit: int | None = None) -> Program:
    """``cand``'s program as compiled, for the analysis: a rewrite's built without tracing
    it (:meth:`Step.rewritten`; ``limit``: raise
    :class:`~jaxmem.rewriting.symbolic.TooLarge` past that many nodes), another's (a
    built-in policy) traced. Raises what the trace raises."""
    if cand.rewrites:
        return step.rewritten(cand.plan, limit)
    return from_jaxpr(cand.jitted.trace(*step.flat).jaxpr)


def _hinted(chosen: tuple[Plan, Any], analysis: Analysis, cap: float) -> tuple[Plan, Any]:
    """The chosen plan with :func:`jaxmem.planning.lower_peaks.hint`'s note (the lower
    peak a budget would reach past the FLOP cap, predicted; nothing compiled for it)."""
    plan, exe = chosen
    note = lower_peaks.hint(analysis, plan, max_recompute_fraction=cap)
    return (dataclasses.replace(plan, notes=plan.notes + (note,)) if note else plan), exe


#: How many candidate plans :func:`verified` compiles first: those with the lowest
#: predicted peaks (and any tied with the last of them). On the zoo's bench steps
#: (benchmarks/results/prediction/plans-*.json) the compiled best was among the three
#: lowest predictions on CPU and the H100 target; among the lowest one or two it was not
#: (resnet: +12.4% on CPU, +4.0% on the H100).
TOP = 3


def ranked(cands: list[Any], analysis: Analysis, plan_of: Callable[[Any], Plan] =
           lambda c: c.plan) -> tuple[list[Any], list[Any]]:
    """``cands`` (candidates, or plans with ``plan_of`` the identity) split into those with
    the :data:`TOP` lowest peaks the cost model predicts for their drop and offload sets
    (:meth:`jaxmem.analyzing.costmodel.CostModel.evaluate`), with every candidate tied with
    the :data:`TOP`-th (the model does not see how a plan groups its re-creation, so plans
    that drop the same values tie, and the compiler tells them apart: a CNN's whole-step
    block plan compiled 1.8% below the per-block one it tied with on the H100 target), and
    the rest, each in the candidates' own order."""
    if len(cands) <= TOP:
        return list(cands), []
    model = CostModel(analysis)
    peak = [model.evaluate(plan_of(c).recompute, plan_of(c).offload).peak for c in cands]
    cut = sorted(peak)[TOP - 1]
    return ([c for c, p in zip(cands, peak, strict=True) if p <= cut],
            [c for c, p in zip(cands, peak, strict=True) if p > cut])


def rewritten_liveness(cand: Candidate, step: Step, platform: str,
                       program: Program | None = None) -> int:
    """The peak the liveness model predicts for ``cand``'s rewritten step itself (with the
    step's arguments and donation, for ``platform``'s compiler): it sees the regions,
    barriers and re-created values the plan's drop set does not. ``program``: the step's
    :func:`rewritten_program` where built already. Raises what the trace raises
    (:func:`rewritten_peak` does not)."""
    program = rewritten_program(cand, step) if program is None else program
    return liveness(program, donated=step.donate_flat, platform=platform)[0]


def rewritten_peak(cand: Candidate, step: Step, platform: str,
                   program: Program | None = None) -> int | None:
    """:func:`rewritten_liveness`, or None when the rewrite cannot be traced here (the
    compile will say why)."""
    try:
        return rewritten_liveness(cand, step, platform, program)
    except Exception:  # noqa: BLE001 - not ranked; compiled or skipped as before
        return None


def with_rewritten_best(first: list[Candidate], rest: list[Candidate], step: Step,
                        platform: str) -> tuple[list[Candidate], list[Candidate]]:
    """``first`` with the candidate of ``first + rest`` whose rewritten step
    (:func:`rewritten_peak`) is predicted lowest, moved out of ``rest`` if it is there.

    The cost model ranks plans by their drop sets, so plans that group their re-creation
    differently tie or swap in it; the rewritten program's own liveness tells them apart
    (``python -m benchmarks.prediction --plans``: on the H100 target it ordered 86-94% of
    the corpus' plan pairs as XLA:GPU did, the cost model 21-83%). Neither alone always
    has the compiled best (the rewritten program's first choice missed it by 25% on the
    zoo GPT on CPU, the model's three by 8.7% on transformers' ResNet18 on the H100 target);
    together they had it on all twelve zoo and corpus bench steps measured there."""
    if not rest:
        return first, rest
    i = rewritten_best(first + rest, step, platform)
    if i is None or i < len(first):
        return first, rest
    best = rest[i - len(first)]
    return first + [best], [c for c in rest if c is not best]


def rewritten_best(cands: list[Candidate], step: Step, platform: str) -> int | None:
    """The index of the candidate whose rewritten step (:func:`rewritten_peak`) is
    predicted lowest, the first of equals; None when none could be traced."""
    peaks = [(p, i) for i, c in enumerate(cands)
             if (p := rewritten_peak(c, step, platform)) is not None]
    return min(peaks)[1] if peaks else None


def _named(cands: list[Candidate]) -> list[str]:
    """The candidates' strategy names, a repeated one numbered (``plan_auto``'s strict
    variant is named ``auto`` too)."""
    seen: dict[str, int] = {}
    out = []
    for c in cands:
        seen[c.plan.strategy] = seen.get(c.plan.strategy, 0) + 1
        n = seen[c.plan.strategy]
        out.append(c.plan.strategy + (f" [{n}]" if n > 1 else ""))
    return out


def _not_compiled(rest: list[str], n: int) -> tuple[str, ...]:
    """The note naming the candidate plans :func:`ranked` left out (``rest``, of ``n``)."""
    if not rest:
        return ()
    return (f"compiled {n - len(rest)} of {n} candidate plans, those with the lowest "
            f"predicted peaks (the cost model's {TOP} and the rewritten step's lowest); "
            f"not compiled: {', '.join(rest)} (verify='all' compiles every one)",)


def within_cap(compiled: list[Compiled], base: Figures, cap: float
               ) -> tuple[list[Compiled], tuple[str, ...]]:
    """The candidates whose compiled FLOPs are within ``cap`` (``max_recompute_fraction``)
    of the plain step's, by the compiler's own count where it reports one (XLA:CPU's
    ``cost_analysis``; the planner's cap is on jaxmem's count, and XLA can count more: a
    flax ResNet18's plan compiled to +5.7% against the 5% cap), and a note for each other
    one. Figures counted by jaxmem (a GPU target compiled without the device) are what the
    planner capped already, and pass."""
    if base.flops_source != "xla" or not base.flops:
        return compiled, ()
    keep, notes = [], []
    for c in compiled:
        extra = c.figures.flops / base.flops - 1.0
        if c.figures.flops_source == "xla" and extra > cap + 1e-9:
            notes.append(f"{c.candidate.plan.strategy} not kept: {extra:+.2%} FLOPs by the "
                         f"compiler's count, above max_recompute_fraction={cap:g}")
        else:
            keep.append(c)
    return keep, tuple(notes)


def verified_as_is(plan: Plan, analysis: Analysis, step: Step) -> tuple[Plan, Any]:
    """A plan whose recompute is all inside loop or ``shard_map`` bodies (``plan.inner``,
    each body planned and compiled on its own: :mod:`.shard_map`, :mod:`.trace_step`),
    compiled as the whole step beside the plain step: a body's lower peak does not make
    the step's lower (the outer program's buffers, layouts and collectives are around it:
    a haiku ResNet18 under ``shard_map`` compiled 17% above plain ``jax.jit`` on the H100
    target). The plain step runs where the plan is not lower, with a warning and a note."""
    base, (compiled,) = compile_candidates(step, [_rewritten(plan, step)])
    if compiled.figures.peak < base.figures.peak:
        return _kept(compiled, base.figures, [plan.strategy], (), step)
    return _plain_kept(plan, analysis, compiled.figures, base, ())


def _rewritten(plan: Plan, step: Step) -> Candidate:
    """``plan`` as a candidate: its jitted rewrite of ``step`` and a lowering thunk."""
    jitted = step.rewrite(plan)
    return Candidate(plan, jitted, cancellable(functools.partial(jitted.lower, *step.flat)),
                     rewrites=True)


def rewrite_candidates(plan: Plan, analysis: Analysis, step: Step,
                       options: Options) -> list[Candidate]:
    """The rewrite's candidate plans (with ``plan``'s donation; ``plan`` itself when there
    are none), each with its jitted rewrite and a lowering thunk."""
    variants = [dataclasses.replace(p, donated=plan.donated) for p in
                strategies.auto_candidates(
                    analysis, max_recompute_fraction=options.max_recompute_fraction)]
    if options.remat_scans:  # scanned layers: their body policy alone is a candidate too
        variants += bodies_only(analysis, plan.donated)
    return [_rewritten(p, step) for p in variants or [plan]]


def builtin_candidates(analysis: Analysis, step: Step, donated: tuple[int, ...]
                       ) -> tuple[list[Candidate], tuple[str, ...]]:
    """The built-in policy itself, around the whole loss and around each of its blocks
    (nn.remat's per-block dots_saveable, blocks from the name stack): a step whose loss
    jax.grad / value_and_grad differentiates gets both as candidates. Lowered here; the
    notes say which could not be."""
    out: list[Candidate] = []
    skipped: tuple[str, ...] = ()
    for per_block in (False, True):
        what = (f"jax.checkpoint(block, policy={LOSS_POLICY}) per block" if per_block
                else f"jax.checkpoint(loss, policy={LOSS_POLICY})")
        loss_jit, wrapped = step.loss(LOSS_POLICY, per_block)
        try:
            loss_lowered = loss_jit.lower(*step.flat)
        except Exception as e:  # noqa: BLE001 - jax.checkpoint cannot take this loss
            skipped += (f"{what} not compiled: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",)
            continue
        if wrapped:  # a differentiated loss (with blocks, per_block) was wrapped
            plan = dataclasses.replace(
                strategies.plan_none(analysis), donated=donated, strategy=what,
                loss_policy=LOSS_POLICY, loss_blocks=per_block)
            out.append(Candidate(plan, loss_jit,
                                 functools.partial(lambda lowered: lowered, loss_lowered)))
    return out, skipped


def compile_candidates(step: Step, cands: list[Candidate]) -> tuple[Compiled, list[Compiled]]:
    """The plain step and ``cands`` compiled side by side in threads, for their figures
    only (:mod:`.quick_compile`): the winner alone is compiled in full to run."""
    plain = Candidate(None, step.plain, cancellable(functools.partial(step.plain.lower,
                                                                      *step.flat)))
    base, *compiled = compile_more(step, [plain] + cands)
    return base, compiled


def compile_more(step: Step, cands: list[Candidate]) -> list[Compiled]:
    """``cands`` compiled side by side in threads, for their figures only."""
    lowered, exes = quick_compile.compile_all([c.lower for c in cands])
    return [Compiled(c, read(exe, c.jitted, step.flat), low, exe) for c, low, exe in
            zip(cands, lowered, exes, strict=True)]


def _kept(best: Compiled, base: Figures, tried: list[str], skipped: tuple[str, ...],
          step: Step) -> tuple[Plan, Any]:
    """The winning candidate, compiled in full to run, with its figures and notes."""
    plan, fig = best.candidate.plan, best.figures
    exe = quick_compile.finish(best.lowered, best.exe)
    if exe is not best.exe:  # figures of what runs: the same, or warned
        fig = quick_compile.checked(fig, read(exe, best.candidate.jitted, step.flat))
    if plan.strategy != "auto" and not plan.strategy.startswith("auto: "):
        plan = dataclasses.replace(plan, strategy=f"auto: {plan.strategy}")
    if plan.loss_policy:  # JAX's partial evaluation chose what is recomputed
        plan = dataclasses.replace(
            plan, recompute_flops=max(fig.flops - base.flops, 0.0),
            notes=plan.notes + (
                f"the step runs as written, its loss differentiated under "
                f"jax.checkpoint(policy=jax.checkpoint_policies.{plan.loss_policy})"
                + (" around each block (blocks from the name stack)"
                   if plan.loss_blocks else "") +
                ": it compiled lower than jaxmem's rewrites here; the residual table "
                "above is the step's own, JAX decides what is recomputed",))
    names = ", ".join(tried)
    note = (f"compiled {len(tried)} candidate plan(s) for {fig.platform or 'cpu'}"
            f" ({names}); kept the lowest peak (within {PEAK_TIE:.2%}, the fewest "
            "FLOPs)")
    plan = dataclasses.replace(plan, notes=plan.notes + (note,) + skipped)
    return plan.with_figures(fig, base), exe


def _plain_kept(plan: Plan, analysis: Analysis, best: Figures | None, base: Compiled,
                skipped: tuple[str, ...]) -> tuple[Plan, Any]:
    """No candidate below the plain step (``best``: the lowest; None: none within the FLOP
    cap): the plain step runs, with a warning and a note."""
    none = dataclasses.replace(strategies.plan_none(analysis), donated=plan.donated)
    what = (f"compiled to a peak of {fmt_bytes(best.peak)}, not below" if best is not None
            else "and every other candidate compiled above the FLOP cap, so none beat")
    note = (f"the {plan.strategy!r} plan {what} the plain step's "
            f"{fmt_bytes(base.figures.peak)}: kept the plain step "
            "(pass verify=False to force the plan, or try a budget)")
    warnings.warn(f"jaxmem.optimize: {note}", stacklevel=7)
    return (dataclasses.replace(none, notes=plan.notes + (note,) + skipped,
                                compiled=base.figures, baseline=base.figures),
            quick_compile.finish(base.lowered, base.exe))
