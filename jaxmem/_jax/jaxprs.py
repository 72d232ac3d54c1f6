"""Jaxpr types, primitives and reading equations (bottom layer, :mod:`jaxmem._jax`).

The ``jax.extend.core`` types jaxmem walks, the primitives it recognises by object
(``name_p``, the optimisation barrier) and by name (the control-flow and call tables), and
how to read an equation: its literals and dropped outputs, the jaxprs nested in its params,
what a call equation runs and whether a nested ``jit`` can be inlined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend  # noqa: F401  (plain `import jax` does not expose jax.extend)
import jax.extend.core as jcore

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
JaxprEqn = jcore.JaxprEqn
Var = jcore.Var
Literal = jcore.Literal
DropVar = jcore.DropVar
Primitive = jcore.Primitive
primitives = jcore.primitives
jaxprs_in_params = jcore.jaxprs_in_params

name_p = primitives.name_p
optimization_barrier_p = getattr(primitives, "optimization_barrier_p", None)
if optimization_barrier_p is None:  # pragma: no cover - depends on the jax version
    from jax._src.lax.lax import optimization_barrier_p  # type: ignore[no-redef]

# Control-flow / call primitives whose nested jaxprs jaxmem walks. Names, not objects, so a
# renamed primitive (pjit -> jit in 0.7) only needs this table updated.
JIT_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call"})
REMAT_NAMES = frozenset({"remat", "remat2", "checkpoint"})
CUSTOM_NAMES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
LOOP_NAMES = frozenset({"scan", "while"})
COND_NAMES = frozenset({"cond"})


def literal_value(x: Any) -> Any:
    return x.val if isinstance(x, Literal) else None


def is_literal(x: Any) -> bool:
    return isinstance(x, Literal)


def inlined_as_literal(c: Any) -> bool:
    """Whether JAX's jaxpr trace writes constant ``c`` read by an equation as a literal of
    that equation (a scalar: one per read) rather than a constant variable of the jaxpr
    (an array: one per constant)."""
    from jax._src import core

    return core.is_literalable(c)


def is_dropvar(x: Any) -> bool:
    return isinstance(x, DropVar)


def sub_jaxprs(eqn: JaxprEqn) -> Sequence[Jaxpr]:
    """Open jaxprs nested in an equation's params (jit, scan, cond branches, while, ...)."""
    return list(jaxprs_in_params(eqn.params))


def closed_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any] = ()) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, list(consts))


def call_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr:
    """The closed jaxpr a call equation (:data:`JIT_NAMES`) runs: ``jit``'s ``jaxpr``,
    ``closed_call``'s ``call_jaxpr`` (what JAX's partial evaluation of a checkpointed loss
    leaves), or ``core_call``'s open one, closed."""
    p = eqn.params
    j = p["jaxpr"] if "jaxpr" in p else p["call_jaxpr"]
    return j if hasattr(j, "consts") else closed_jaxpr(j)


def jit_inlinable(eqn: JaxprEqn) -> bool:
    """A nested ``jit`` can be inlined when it pins no shardings or layouts of its own."""
    p = eqn.params
    for key in ("in_shardings", "out_shardings"):
        if any(type(s).__name__ != "UnspecifiedValue" for s in p.get(key, ())):
            return False
    for key in ("in_layouts", "out_layouts"):
        if any(lay is not None for lay in p.get(key, ())):
            return False
    return not p.get("compiler_options_kvs")
