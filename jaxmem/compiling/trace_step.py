"""The step traced for planning: scan bodies under a checkpoint policy, loops planned.

Part of the fifth box (:mod:`jaxmem.compiling`). The joint rewrite keeps a ``lax.scan``
whole, so with ``remat_scans`` the step is traced with its scan bodies under
``jax.checkpoint(policy=jaxmem.policies.utility)`` (or the policy given), gradient-
accumulation loop bodies and ``shard_map`` bodies planned as steps of their own on the way
(:class:`jaxmem.rewriting.scans.TrainBodies`, :mod:`.shard_map`). A step that scans its
layers gets its body policy chosen first, compile-checked: under a budget by the search of
:mod:`.scan_budget`, without one the leaner policy within the FLOP cap when it compiles lower
(:func:`jaxmem.compiling.scan_budget.auto_choice`); the step is then traced under it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxmem import _jax
from jaxmem.compiling.options import Options
from jaxmem.compiling.scan_budget import auto_choice, choose_for
from jaxmem.compiling.shard_map import BodyPlanner, StepBudget, plan_bodies
from jaxmem.compiling.steps import figures, plain_for, read
from jaxmem.rewriting.policies import utility
from jaxmem.rewriting.scans import TrainBodies
from jaxmem.tracing import structure
from jaxmem.tracing.program import Program, trace
from jaxmem.xla import measure


class Traced(NamedTuple):
    """The step's labelled program and what its scan and loop bodies were planned as."""

    program: Program
    loop_plans: tuple[Any, ...]  # plans of loop and shard_map bodies planned on their own
    body: Any  # a budget's scan-body choice (scan_budget.BodyChoice), or None
    lean_notes: tuple[str, ...]  # the notes of the leaner body policy chosen without one
    # under a budget on a step with shard_map bodies: the whole step's budget they were
    # planned for (its plain step compiled once; the lowest peak a body's search reached)
    bodies_budget: StepBudget | None = None


def trace_step(opt: Any, options: Options, fn: Callable[..., Any],
               dyn_args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
    """Trace ``fn(*dyn_args, **kwargs)`` for planning, its scan-body policy chosen first.
    ``opt``: the :class:`~jaxmem.optimized.Optimized` being built, which the body-policy
    choice compiles candidates through (:func:`jaxmem.compiling.scan_budget.choose_for`)."""
    body = None  # a budget picks the scan bodies' policy too (jaxmem.compiling.scan_budget)
    lean = None  # no budget: a leaner body policy within the FLOP cap, compile-checked
    program, loop_plans, bodies_budget = traced(type(opt), options, fn, dyn_args, kwargs)
    # Only a step that scans can have a body policy to choose: the choice traces the
    # step again under each candidate, so a step without a scan skips it (one trace).
    if (options.remat_scans is True and options.strategy != "none"
            and scans(program.jaxpr.jaxpr)):
        if options.budget is not None:
            body = choose_for(opt, fn, dyn_args, kwargs)
        elif options.verify:
            lean = auto_choice(opt, fn, dyn_args, kwargs)
        if body or lean:
            program, loop_plans, bodies_budget = traced(type(opt), options, fn, dyn_args, kwargs,
                                         body.policy if body else lean[0])
    return Traced(structure.label(program), loop_plans, body, lean[1] if lean else (),
                  bodies_budget)


def traced(optimizer: Callable[..., Any], options: Options, fn: Callable[..., Any],
           dyn_args: tuple[Any, ...], kwargs: dict[str, Any],
           policy: Any = None) -> tuple[Program, tuple[Any, ...], StepBudget | None]:
    """The step's program, and the plans of the loop and shard_map bodies planned as
    steps of their own on the way; scan bodies under jax.checkpoint(policies.utility)
    when ``remat_scans`` (the joint rewrite keeps a scan whole), or under ``policy`` (or
    the policy ``remat_scans`` is). ``optimizer``: makes the ``Optimized`` of a body.
    Third: under a budget, the budget the ``shard_map`` bodies were planned for
    (:attr:`Traced.bodies_budget`; None without a budget)."""
    if options.remat_scans and options.strategy != "none":
        policy = policy or (utility if options.remat_scans is True else options.remat_scans)
        bodies = TrainBodies(lambda body: optimizer(  # gradient-accumulation loops
            body, donate_argnums=(), verify=options.verify is not False,
            max_recompute_fraction=options.max_recompute_fraction))
        with _jax.checkpointed_scan_bodies(policy, bodies):
            program = trace(fn, *dyn_args, **kwargs)
        sharded = BodyPlanner(options.max_recompute_fraction, options.verify is not False,
                              budget=(_step_budget(options, fn, dyn_args, kwargs, program)
                                      if options.budget is not None else None))
        program = plan_bodies(program, sharded)
        loop_plans = tuple(bodies.plans) + tuple(sharded.plans)
        if program.has_backward or loop_plans:
            return program, loop_plans, sharded.budget
    return trace(fn, *dyn_args, **kwargs), (), None  # nothing differentiated: untouched


def _step_budget(options: Options, fn: Callable[..., Any], dyn_args: tuple[Any, ...],
                 kwargs: dict[str, Any], program: Program) -> StepBudget:
    """The budget of the step whose ``shard_map`` bodies are planned: its plain ``jax.jit``
    (the step's donation) compiled once, when a body first asks; a body's candidates
    compiled as ``program`` with that body, donated the same way."""
    jitted, donate = plain_for(fn, dyn_args, kwargs, options.donate_argnums, program,
                               options.jit_kwargs)
    flat = jax.tree_util.tree_leaves((dyn_args, kwargs))

    @functools.cache
    def plain() -> tuple[Any, Any]:
        exe = measure.compile(jitted.lower(*flat))
        return exe, read(exe, jitted, flat)

    def compile_with(eqn: Any, body: Callable[..., Any]) -> Any:
        step = plan_bodies(program, lambda e: body if e is eqn else None)
        return figures(jax.jit(_jax.jaxpr_fun(step.jaxpr), donate_argnums=donate,
                               **options.jit_kwargs), flat)

    return StepBudget(options.budget, plain, compile_with)


def scans(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or any program nested in it) has a ``scan``."""
    return any(e.primitive.name == "scan" or any(scans(s) for s in _jax.sub_jaxprs(e))
               for e in jaxpr.eqns)
