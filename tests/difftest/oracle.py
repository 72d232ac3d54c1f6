"""The op-by-op oracle: is a rewritten step the original program, primitive for primitive?

A recompute re-emits an equation on the same inputs; a barrier and a ``device_put`` pass
values through. So, evaluated one primitive at a time (each primitive compiled on its own,
with no fusion across primitives), the step ``jaxmem.optimize`` runs and the step the user
wrote must give **bitwise equal** outputs, whatever the rounding of either. Compiled whole,
they may differ in their last bits: XLA fuses the two programs differently (a reduction
re-associated, a multiply-add contracted), and a leaf that is rounding noise (a gradient
that is zero in exact arithmetic, such as a bias's ahead of a normalisation) can then
differ by more than its own size. :func:`same_program` tells the two apart: the check
(:mod:`.check`) asks it about every float leaf whose compiled values are outside the
tolerance, and counts a mismatch only when the op-by-op values differ too.

:func:`evaluate` walks a closed jaxpr and binds every primitive eagerly; the primitives that
hold sub-programs (nested ``jit``, ``remat``, ``custom_jvp``/``custom_vjp`` calls, ``scan``,
``while``, ``cond``) are walked into, so that their bodies are evaluated op by op as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

#: Primitives that pass their operands through: values are unchanged (placement, scheduling).
_IDENTITY = frozenset({"optimization_barrier", "device_put"})
#: Call-like primitives: parameter holding the sub-program (closed or open jaxpr).
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr"}


def evaluate(closed: Any, *args: Any) -> list[Any]:
    """Outputs of ``closed`` (a ``ClosedJaxpr``) on ``args``, one primitive at a time."""
    return _eval(closed.jaxpr, closed.consts, args)


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _sub(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    if hasattr(jaxpr, "consts"):  # ClosedJaxpr
        return _eval(jaxpr.jaxpr, jaxpr.consts, args)
    return _eval(jaxpr, (), args)


def _eqn(eqn: Any, ins: list[Any]) -> list[Any]:
    name, p = eqn.primitive.name, eqn.params
    if name in _IDENTITY:
        return list(ins)
    if name in _CALLS and _CALLS[name] in p:
        return _sub(p[_CALLS[name]], ins)
    if name == "scan":
        return _scan(p, ins)
    if name == "while":
        return _while(p, ins)
    if name == "cond":
        index, ops = ins[0], ins[1:]
        return _sub(p["branches"][int(index)], ops)
    outs = eqn.primitive.bind(*ins, **p)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _scan(p: dict[str, Any], ins: list[Any]) -> list[Any]:
    nc, nk, n = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
    steps = range(n - 1, -1, -1) if p["reverse"] else range(n)
    ys: list[list[Any]] = []
    for i in steps:
        out = _sub(p["jaxpr"], [*consts, *carry, *(x[i] for x in xs)])
        carry, y = out[:nk], out[nk:]
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    n_ys = len(p["jaxpr"].jaxpr.outvars) - nk
    stacked = [jnp.stack([y[k] for y in ys]) if ys else
               jnp.zeros((0, *p["jaxpr"].out_avals[nk + k].shape),
                         p["jaxpr"].out_avals[nk + k].dtype) for k in range(n_ys)]
    return [*carry, *stacked]


def _while(p: dict[str, Any], ins: list[Any]) -> list[Any]:
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, state = ins[:cn], ins[cn:cn + bn], list(ins[cn + bn:])
    while bool(_sub(p["cond_jaxpr"], [*cconsts, *state])[0]):
        state = _sub(p["body_jaxpr"], [*bconsts, *state])
    return state


def bitwise(a: Any, b: Any) -> bool:
    """Equal bit for bit (same shape and dtype; NaN equal to NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "biu" or a.dtype == np.dtype(jax.dtypes.float0):
        return bool(np.array_equal(a, b))
    return bool(np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True))
