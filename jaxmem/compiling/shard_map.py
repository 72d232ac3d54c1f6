"""Plans inside ``jax.shard_map`` bodies: a data-parallel step planned per device.

Third and fourth boxes of the data flow (``Analysis -> Plan -> new function``) for a step
whose forward and backward passes live inside a ``shard_map`` body (``pmean`` of the loss and
gradients: data parallelism written by hand). The joint rewrite of the outer step keeps the
``shard_map`` equation whole, like a scan, and sees no backward pass. Here the body is
planned as a train step of its own, on its *per-device* shapes (the body's jaxpr has them):

1. the body's jaxpr becomes a :class:`~jaxmem.program.Program`, analysed as any step;
2. MEDL's auto plan and its per-block variants (:func:`jaxmem.planning.strategies.auto_candidates`)
   are rewritten and each is compiled as a ``shard_map`` over the body's own mesh and specs,
   with the plain body beside them, for the mesh's target; the lowest per-device peak is
   kept (the plain body when no plan is lower: never worse than ``jax.jit``);
3. the chosen rewrite becomes the ``shard_map``'s body in the outer program.

Collectives in the body (``psum``, ``all_gather``, ``ppermute``...) are *unknown* to the
planner's tables (:mod:`jaxmem.primitives`), so their outputs are anchors: kept, never
recomputed (:mod:`jaxmem.analyzing.chains`). Only the arithmetic between them is replayed, with one
exception, FSDP's trade-off (:func:`regather`): a parameter shard's ``all_gather`` may be
re-run in the backward pass instead of keeping the gathered weight, when the communication
it adds (bytes over :attr:`DeviceProfile.interconnect_bw`) stays within
``max_recompute_fraction`` of the step's predicted time; such plans are candidates beside
the ones that keep the gathered weights, and the compiled peak decides.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> def body(w, x):
  ...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  ...     return jax.lax.pmean(loss, "data"), jax.lax.pmean(g, "data")
  >>> step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
  >>> closed = jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((2, 4)))
  >>> [e.primitive.name for e in closed.jaxpr.eqns if has_backward_body(e)]
  ['shard_map']
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.analyzing.analysis import Analysis, from_program
from jaxmem.analyzing.costmodel import PROFILES, DeviceProfile
from jaxmem.compiling.choose import ranked
from jaxmem.planning import strategies
from jaxmem.planning.budget.search import plan_with_budget
from jaxmem.planning.budget.units import BudgetError, resolve_budget
from jaxmem.planning.plan import Choice, Decision, Plan
from jaxmem.rewriting.rewrite import apply
from jaxmem.tracing import structure
from jaxmem.tracing.program import Program, from_jaxpr
from jaxmem.xla import measure, targets
from jaxmem.xla.measure import Figures, fmt_bytes, lowest

__all__ = ["BodyPlanner", "StepBudget", "has_backward_body", "plan_bodies", "regather"]


def _has_backward(jaxpr: Any) -> bool:
    return any(_jax.is_backward(e) or any(_has_backward(s) for s in _jax.sub_jaxprs(e))
               for e in jaxpr.eqns)


def has_backward_body(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``shard_map`` whose body holds a backward pass."""
    return eqn.primitive.name == "shard_map" and _has_backward(eqn.params["jaxpr"])


def _wrap(eqn: Any, body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` (flat per-device inputs -> flat outputs) under ``eqn``'s mesh and specs."""
    return jax.shard_map(lambda *a: tuple(body(*a)), **_jax.shard_map_kwargs(eqn))


def _with_body(eqn: Any, body: Callable[..., Any]) -> Any:
    """``eqn`` with its body replaced by ``body``'s trace (same mesh, specs, avals)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                  sharding=getattr(v.aval, "sharding", None))
             for v in eqn.invars]
    closed = jax.make_jaxpr(_wrap(eqn, body))(*avals)
    inner = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    if len(inner) != 1:
        raise ValueError("re-tracing the planned shard_map body gave "
                         f"{len(inner)} shard_map equations, not one")
    return _jax.replace_params(eqn, inner[0].params)


def _abstract_args(eqn: Any) -> list[Any]:
    """The ``shard_map``'s global inputs as abstract arrays on its mesh (compile-only)."""
    from jax.sharding import NamedSharding

    mesh = eqn.params["mesh"]
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                 sharding=NamedSharding(mesh, spec))
            for v, spec in zip(eqn.invars, eqn.params["in_specs"], strict=True)]


def _compiled(eqn: Any, body: Callable[..., Any], args: Sequence[Any]) -> Figures:
    jitted = jax.jit(_wrap(eqn, body))
    exe = measure.compile(jitted.lower(*args))
    platform = targets.platform_of(args) or jax.default_backend()
    return measure.compiled_figures(exe, jitted, args, platform=platform)


def _platform(eqn: Any) -> str:
    """The platform of the mesh's devices (the default backend's where it names none)."""
    devices = getattr(eqn.params["mesh"], "devices", None)
    return str(getattr(devices.flat[0], "platform", "cpu")) if devices is not None \
        else jax.default_backend()


def _apply(eqn: Any, program: Program, plan: Plan) -> Callable[..., list[Any]]:
    """The rewrite of ``plan`` for the mesh's platform (its accelerator orderings,
    :class:`jaxmem.compiling.steps.Step.rewrite`, where the mesh's devices are not CPUs)."""
    accelerator = _platform(eqn) != "cpu"
    return apply(program, plan, settle_host=accelerator, fence_gradients=accelerator)


def _profile(eqn: Any) -> DeviceProfile:
    """The device profile preset of the mesh's devices (``cpu`` where unknown)."""
    devices = getattr(eqn.params["mesh"], "devices", None)
    kind = str(getattr(devices.flat[0], "device_kind", "cpu")) if devices is not None else ""
    kind = kind.lower().replace(" ", "")
    return next((PROFILES[k] for k in ("h200", "h100", "a100") if k in kind), PROFILES["cpu"])


def _gathered_weights(analysis: Analysis, plan: Plan) -> list[Choice]:
    """Kept residuals made by an ``all_gather`` of body inputs (FSDP's parameter shards)."""
    prog = analysis.program
    out = []
    for c in plan.choices:
        v = prog.values[c.residual.value]
        if c.decision is not Decision.SAVE or v.producer is None:
            continue
        node = prog.nodes[v.producer]
        if node.primitive == "all_gather" and all(
                prog.values[i].is_input or prog.values[i].is_const for i in node.inputs):
            out.append(c)
    return out


def regather(analysis: Analysis, plan: Plan, profile: DeviceProfile,
             max_fraction: float) -> Plan | None:
    """``plan`` with the gathered weights re-gathered in the backward pass instead of kept
    (FSDP's trade-off: memory for communication); ``None`` when the body gathers no
    parameter shards or the extra communication, each gathered weight fetched once more
    over the interconnect, exceeds ``max_fraction`` of the body's predicted time."""
    gathered = _gathered_weights(analysis, plan)
    if not gathered:
        return None
    nbytes = sum(c.residual.nbytes for c in gathered)
    comm = profile.collective_time(nbytes)
    step = sum(profile.node_time(n.flops, n.bytes_moved) for n in analysis.program.nodes)
    if comm > max_fraction * step:
        return None
    note = (f"FSDP: {len(gathered)} gathered weights ({fmt_bytes(nbytes)}) re-gathered in the "
            f"backward pass instead of kept: predicted {1e3 * comm:.3f} ms more on the "
            f"interconnect ({profile.name}, {profile.interconnect_bw / 1e9:.0f} GB/s), "
            f"{100 * comm / max(step, 1e-12):.1f}% of the body's predicted time")
    flip = {c.residual.value for c in gathered}
    choices = tuple(Choice(c.residual, Decision.RECOMPUTE, "all_gather of a parameter "
                           "shard: re-gathered in the backward pass")
                    if c.residual.value in flip else c for c in plan.choices)
    return dataclasses.replace(plan, choices=choices, strategy=f"{plan.strategy} + re-gather",
                               notes=plan.notes + (note,))


@dataclasses.dataclass
class StepBudget:
    """A budget on the step around the ``shard_map`` bodies, for :class:`BodyPlanner`.

    Attributes:
      spec: the budget as given to ``optimize`` (bytes, a string, a fraction of the plain
        step's peak).
      compiled_plain: ``() -> (executable, Figures)`` of the user's step under plain
        ``jax.jit`` (its donation), compiled on first use and once: the budget check of
        the whole step runs that executable where the plain step fits.
      compile: ``(eqn, body) -> Figures`` of the whole step with ``eqn``'s body replaced by
        ``body`` (flat per-device inputs -> flat outputs), compiled the same way.
      lowest: the lowest whole-step peak a body's budget search reached where it missed (a
        lower bound, the body's arguments' size, where the budget is below that).
      why: that search's error, its first sentence.
    """

    spec: Any
    compiled_plain: Callable[[], tuple[Any, Figures]]
    compile: Callable[[Any, Callable[..., Any]], Figures]
    lowest: int | None = None
    why: str = ""

    def plain(self) -> Figures:
        """The plain step's figures."""
        return self.compiled_plain()[1]

    @property
    def requested(self) -> int:
        """The budget in bytes (a fraction resolved against the plain step's peak)."""
        return resolve_budget(self.spec, self.plain().peak)


@dataclasses.dataclass
class BodyPlanner:
    """Plans one ``shard_map`` body: :func:`jaxmem.planning.strategies.auto_candidates` compiled
    per device on the mesh, lowest peak kept (``verify``), as ``jaxmem.optimize`` does for a
    whole step. ``plans`` collects what was chosen, for the outer plan's notes."""

    max_recompute_fraction: float = 0.05
    verify: bool = True
    plans: list[Plan] = dataclasses.field(default_factory=list)
    #: Under a budget: the whole step's (:class:`StepBudget`). The body is then planned by
    #: the budget search (:func:`jaxmem.planning.budget.search.plan_with_budget`), each
    #: candidate compiled as the whole step with it as its body (a body's own per-device
    #: peak does not move with the step's one for one: the step donates its state).
    budget: StepBudget | None = None

    def __call__(self, eqn: Any) -> Callable[..., Any] | None:
        program = structure.label(from_jaxpr(_jax.closed_jaxpr(eqn.params["jaxpr"])))
        analysis = from_program(program, platform=_platform(eqn))
        cands = strategies.auto_candidates(
            analysis, max_recompute_fraction=self.max_recompute_fraction)
        profile = _profile(eqn)
        cands += [p for p in (regather(analysis, c, profile, self.max_recompute_fraction)
                              for c in cands) if p is not None]
        if not cands:
            return None
        missed: tuple[str, ...] = ()
        if not self.verify:
            return self._chosen(eqn, program, cands[0], None, None)
        if not isinstance(eqn.params["mesh"], jax.sharding.Mesh):
            warnings.warn("jaxmem.optimize: a shard_map body on an abstract mesh was kept "
                          "whole (its plans cannot be compiled to check them); pass a "
                          "concrete jax.sharding.Mesh", stacklevel=6)
            return None
        args = _abstract_args(eqn)
        base = _compiled(eqn, _jax.jaxpr_fun(program.jaxpr), args)
        first, rest = ranked(cands, analysis, plan_of=lambda p: p)  # as verify does
        if self.budget is not None:
            within = self._within_budget(eqn, program, analysis, cands[0], args, base)
            if within is not None:
                return self._chosen(eqn, program, within, within.compiled, base)
            if self.budget.lowest is not None:
                missed = (f"no plan of the body meets the budget ({self.budget.why}); "
                          "the lowest per-device peak is planned instead",)
        figs = [_compiled(eqn, _apply(eqn, program, plan), args) for plan in first]
        if rest and min(f.peak for f in figs) >= base.peak:  # none below: the others too
            first += rest
            figs += [_compiled(eqn, _apply(eqn, program, plan), args) for plan in rest]
        i = lowest(figs)
        best = (dataclasses.replace(first[i], notes=first[i].notes + missed), figs[i])
        if best[1].peak >= base.peak:
            self.plans.append(dataclasses.replace(
                strategies.plan_none(analysis), strategy="shard_map body: none",
                notes=(f"no plan's per-device peak was below the plain body's "
                       f"{fmt_bytes(base.peak)}: the body is kept as it is",)))
            return None
        return self._chosen(eqn, program, best[0], best[1], base)

    def _within_budget(self, eqn: Any, program: Program, analysis: Analysis, auto: Plan,
                       args: Sequence[Any], base: Figures) -> Plan | None:
        """The body's plan under the step's budget, its figures the whole step's; None
        (the lowest per-device peak is chosen instead, and the step's check then says what
        it reaches) when the plain step already fits or no body plan makes the step fit."""
        whole = self.budget
        if whole.plain().peak <= whole.requested:  # nothing to plan for the budget
            return None
        try:
            plan = plan_with_budget(
                analysis, whole.requested, auto=auto,
                compile_plan=lambda p: whole.compile(eqn, _apply(eqn, program, p)),
                compile_plain=whole.plain)
        except BudgetError as e:
            whole.lowest = min(whole.lowest or e.minimum_bytes, e.minimum_bytes)
            whole.why = str(e).split(". ")[0]
            return None
        fig = _compiled(eqn, _apply(eqn, program, plan), args)
        note = (f"budget {fmt_bytes(whole.requested)}: the body planned by the budget search, "
                f"each candidate compiled as the whole step (plain "
                f"{fmt_bytes(whole.plain().peak)})")
        return dataclasses.replace(plan, notes=plan.notes + (note,), compiled=fig)

    def _chosen(self, eqn: Any, program: Program, plan: Plan, fig: Figures | None,
                base: Figures | None) -> Callable[..., Any]:
        note = ("per device: " + (f"{fmt_bytes(base.peak)} -> {fmt_bytes(fig.peak)} compiled"
                                  if fig is not None else "not compiled (verify=False)"))
        kept = _gathered_weights(from_program(program), plan)
        if kept:
            note += (f"; FSDP: {len(kept)} gathered weights "
                     f"({fmt_bytes(sum(c.residual.nbytes for c in kept))}) kept for the "
                     "backward pass, not re-gathered")
        self.plans.append(dataclasses.replace(
            plan, strategy=f"shard_map body: {plan.strategy}", notes=plan.notes + (note,),
            compiled=fig, baseline=base))
        return _apply(eqn, program, plan)


def _rewrite_jaxpr(jaxpr: Any, plan_body: Callable[[Any], Any]) -> tuple[Any, bool]:
    """``jaxpr`` with each ``shard_map`` body that has a backward pass planned (inside
    nested ``jit`` equations too); whether anything changed."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new = eqn
        if has_backward_body(eqn):
            body = plan_body(eqn)
            if body is not None:
                new = _with_body(eqn, body)
        elif eqn.primitive.name in _jax.JIT_NAMES and _has_backward(_jax.call_jaxpr(eqn).jaxpr):
            inner, sub = _rewrite_jaxpr(_jax.call_jaxpr(eqn).jaxpr, plan_body)
            key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
            if sub and hasattr(eqn.params[key], "consts"):  # core_call's open jaxpr: as is
                closed = _jax.closed_jaxpr(inner, eqn.params[key].consts)
                new = _jax.replace_params(eqn, dict(eqn.params, **{key: closed}))
        changed |= new is not eqn
        eqns.append(new)
    return (_jax.with_eqns(jaxpr, eqns) if changed else jaxpr), changed


def plan_bodies(program: Program, plan_body: Callable[[Any], Any]) -> Program:
    """``program`` with its ``shard_map`` bodies planned by ``plan_body`` (a
    :class:`BodyPlanner`): each body that holds a backward pass is replaced by its rewrite.
    The program itself when there is none."""
    closed = program.jaxpr
    if closed is None or not any(has_backward_body(e) or e.primitive.name in _jax.JIT_NAMES
                                 for e in closed.jaxpr.eqns):
        return program
    jaxpr, changed = _rewrite_jaxpr(closed.jaxpr, plan_body)
    if not changed:
        return program
    return from_jaxpr(_jax.closed_jaxpr(jaxpr, closed.consts), program.in_tree,
                      program.out_tree)
