"""``verify="background"``: verify the plan in a thread while the first calls run.

Part of the fifth box (:mod:`jaxmem.compiling`). The first call runs one unverified
candidate (:func:`first_to_run`); the candidates' verifying compiles
(:func:`jaxmem.compiling.choose.verified`) run on one background thread for the process
(:func:`in_background`), on abstract stand-ins of the arguments (the first call donated
the arrays: :func:`stand_ins`), once the first call's own executable is compiled; the
verified plan takes over at the first call after it is done (:func:`adopt`). At interpreter
exit the thread stops before its next compile (:func:`cancellable`). Where the thread
would trace differently (a thread-local JAX context: :func:`thread_sees_context`), or the
deferral is not allowed (:func:`can_defer`), the plan is verified before the first call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxmem import _jax
from jaxmem.compiling import plan_cache
from jaxmem.compiling.entry import Entry
from jaxmem.compiling.options import Options
from jaxmem.compiling.steps import Step
from jaxmem.planning.plan import Plan
from jaxmem.xla import measure
from jaxmem.xla.measure import fmt_bytes

log = logging.getLogger("jaxmem")
#: Set when the interpreter exits: background verifications stop before their next compile
#: (a non-daemon thread is joined at exit; this keeps that wait to the compiles in flight).
_CANCEL = threading.Event()
threading._register_atexit(_CANCEL.set)  # noqa: SLF001 - before non-daemon threads are joined

#: The note a plan carries while its verification is pending.
NOT_VERIFIED = ("not verified yet: verify='background' compiles the candidate plans and "
                "the plain step beside the first calls, and the lowest takes over at the "
                "first call after that (step.plan(...) waits for it)")


class Cancelled(Exception):
    """The interpreter is exiting: a background verification stops."""


_VERIFIER: concurrent.futures.ThreadPoolExecutor | None = None


def in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run ``fn`` on the background-verification thread (one for the process, created on
    first use: verifications queue rather than share the cores); its result in a future.
    Its worker is joined at exit after :data:`_CANCEL` is set (``_register_atexit`` calls
    run last-registered first, and concurrent.futures registered before jaxmem)."""
    global _VERIFIER
    if _VERIFIER is None:
        _VERIFIER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxmem-verify")
    return _VERIFIER.submit(fn)


def thread_sees_context() -> bool:
    """Whether a new thread traces under this thread's JAX configuration: context managers
    (``jax.default_matmul_precision``, ``enable_x64``, ...) are thread-local, and a
    background trace under different settings would be a different program."""
    here, there = _jax.trace_context(), []
    t = threading.Thread(target=lambda: there.append(_jax.trace_context()))
    t.start()
    t.join()
    return bool(there) and there[0] == here


def can_defer(options: Options, planning: bool, cached: Plan | None) -> bool:
    """Whether the first call may run an unverified candidate: ``verify="background"``,
    a step to plan with no budget, offload of its state or cached plan, on a single
    process (hosts must run the same program at every step), and only where the thread
    traces the same way."""
    return (options.verify == "background" and planning and options.budget is None
            and options.offload_state is False and jax.process_count() == 1
            and cached is None and thread_sees_context())


def first_to_run(plan: Plan, candidates: Sequence[Plan], notes: tuple[str, ...]) -> Plan:
    """The plan ``verify="background"`` runs until the verified one is ready: the candidate
    that drops the most bytes, the fewest recompute FLOPs among equals. (On the zoo GPT at
    bench size on CPU that is ``selective``: the lowest compiled peak of the six and the
    quickest to compile, 12.9 s against MEDL's per-layer plan's 24.7 s.)"""
    if not candidates:
        return plan
    best = max(candidates, key=lambda p: (p.dropped_bytes, -p.recompute_flops))
    return dataclasses.replace(best, donated=plan.donated, notes=best.notes + notes)


def cancellable(lower: Callable[[], Any]) -> Callable[[], Any]:
    """``lower``, unless the interpreter is exiting (:data:`_CANCEL`)."""
    def call() -> Any:
        if _CANCEL.is_set():
            raise Cancelled("the interpreter is exiting")
        return lower()
    return call


def stand_ins(tree: Any) -> Any:
    """Abstract stand-ins (shape, dtype, weak type, sharding) for the arrays of ``tree``:
    what a background compile lowers with after the first call donated the arrays."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=getattr(x, "weak_type", False))
        return x
    return jax.tree.map(one, tree)


def schedule(entry: Entry, step: Step, verify: Callable[[Step], tuple[Plan, Any]],
             key: str | None, notes: tuple[str, ...], bar: int) -> None:
    """Leave ``entry``'s verification for later: ``verify(step)`` (the step on stand-ins
    of its arguments) gives the verified plan and its executable, which gets ``notes``
    and goes to the plan cache under ``key``. It starts after the first call's compile
    (:func:`start`); the first plan runs unverified only where it compiles below ``bar``
    (:func:`verify_first_if_no_better`)."""
    stand = stand_ins(step.args)
    on_stand_ins = dataclasses.replace(step, args=stand, flat=jax.tree_util.tree_leaves(stand))

    def verify_later() -> tuple[Plan, Any, Any]:
        best, exe = verify(on_stand_ins)
        best = dataclasses.replace(best, notes=best.notes + notes)
        if key:
            plan_cache.store(key, best)
        return best, step.running(best), exe
    entry.verify_later = verify_later
    entry.first_plan_bar = bar


def start(entry: Entry) -> None:
    """Start ``entry``'s pending verification on the background thread (if any)."""
    if entry.verify_later is not None:
        entry.pending, entry.verify_later = in_background(entry.verify_later), None


def verify_first_if_no_better(entry: Entry) -> None:
    """After the first compile: an unverified plan that compiled no lower than its bar
    (the plain step's predicted peak less the model's error bound) waits for its
    verification before the first call runs."""
    if entry.verify_later is None or entry.first_plan_bar is None:
        return
    peak = measure.figures(entry.compiled).peak
    if peak >= entry.first_plan_bar:  # unverified and no better: verify first
        log.info("jaxmem: the unverified %r plan compiled to %s, not below %s (the plain "
                 "step's predicted peak less the model's error bound): verifying before "
                 "the first call", entry.plan.strategy, fmt_bytes(peak),
                 fmt_bytes(entry.first_plan_bar))
        adopt(entry, wait=True)


def adopt(entry: Entry, wait: bool = False) -> None:
    """Take the background verification's plan, once it is done (or ``wait`` for it)."""
    if wait:
        start(entry)
    fut = entry.pending
    if fut is None or not (wait or fut.done()):
        return
    entry.pending = None
    try:
        plan, jitted, compiled = fut.result()
    except Exception as e:  # noqa: BLE001 - the running plan stays; say why
        note = (f"background verification failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); the unverified "
                f"{entry.plan.strategy!r} plan keeps running (verify=True or 'builtins' "
                "verifies before the first call)")
        log.warning("jaxmem: %s", note)
        entry.plan = dataclasses.replace(entry.plan, notes=entry.plan.notes + (note,))
        return
    note = (f"verified in the background: ran the unverified {entry.plan.strategy!r} plan "
            f"for the first {entry.calls} call(s), then this one" if entry.calls else
            f"verified before the first call: the unverified {entry.plan.strategy!r} plan "
            "did not compile below the plain step's predicted peak by the model's error "
            "bound (PLAIN_ERROR)")
    log.info("jaxmem: %s (%s)", note, plan.strategy)
    entry.plan = dataclasses.replace(plan, notes=plan.notes + (note,))
    entry.jitted, entry.compiled, entry.placed = jitted, compiled, {}
