"""Jaxpr surgery (bottom layer, :mod:`jaxmem._jax`): jaxprs and equations rebuilt with new
parts, for :mod:`jaxmem.compiling.shard_map`.

An equation with new params, a jaxpr with new equations, the ``jax.shard_map`` keyword
arguments that re-create a ``shard_map`` equation, a closed jaxpr as a function, and a
closed jaxpr without its dead equations.
(:func:`~jaxmem._jax.jaxprs.closed_jaxpr`, which closes an open jaxpr, is with the types.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend  # noqa: F401  (plain `import jax` does not expose jax.extend)
import jax.extend.core as jcore

from jaxmem._jax.jaxprs import ClosedJaxpr, Jaxpr, JaxprEqn


def replace_params(eqn: JaxprEqn, params: dict[str, Any]) -> JaxprEqn:
    """``eqn`` with new params (same inputs, outputs, effects and source info)."""
    return eqn.replace(params=dict(params))


def live_only(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` without the equations none of its outputs depends on (JAX's own dead-code
    elimination, ``partial_eval.dce_jaxpr``, into nested jaxprs; effectful equations stay):
    what XLA's DCE also removes before it computes anything."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                            instantiate=True)
    return jcore.ClosedJaxpr(jaxpr, closed.consts)


def with_eqns(jaxpr: Jaxpr, eqns: Sequence[JaxprEqn]) -> Jaxpr:
    """``jaxpr`` with its equations replaced (same inputs, outputs and effects)."""
    return jaxpr.replace(eqns=list(eqns))


def shard_map_kwargs(eqn: JaxprEqn) -> dict[str, Any]:
    """``jax.shard_map`` keyword arguments that re-create a ``shard_map`` equation (its
    params: ``mesh``, ``in_specs``, ``out_specs``, ``check_vma``, ``newly_manual_axes``)."""
    p = eqn.params
    kw: dict[str, Any] = dict(mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                              out_specs=tuple(p["out_specs"]))
    if "check_vma" in p:
        kw["check_vma"] = p["check_vma"]
    elif "check_rep" in p:  # pragma: no cover - older jax
        kw["check_vma"] = p["check_rep"]
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    if axes is not None:
        kw["axis_names"] = set(axes)
    return kw


def jaxpr_fun(closed: ClosedJaxpr) -> Any:
    """``closed`` as a function of its flat inputs returning its flat outputs."""
    return jcore.jaxpr_as_fun(closed)
