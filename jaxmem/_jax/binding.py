"""Re-binding a traced equation's primitive (bottom layer, :mod:`jaxmem._jax`).

How the rewrites re-emit an equation of the traced program: its primitive bound again with
the params ``get_bind_params`` gives, on arguments cast up to the manual axes the traced
inputs varied over alike (inside ``shard_map``; outside it nothing changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax._src.interpreters import partial_eval as _pe

from jaxmem._jax.avals import _aval_varying, varying_axes
from jaxmem._jax.jaxprs import JaxprEqn


def bind_params(eqn: JaxprEqn) -> dict[str, Any]:
    """Params to re-bind an equation's primitive (``get_bind_params`` returns one dict)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # pragma: no cover - jax < 0.7 returned (subfuns, params)
        subfuns, params = params
        if subfuns:
            raise NotImplementedError(f"cannot rebind {eqn.primitive} with subfuns")
    return params


def staging_rules(primitive: Any) -> tuple[Any, Any]:
    """The rules JAX's jaxpr trace applies when ``primitive`` is bound: its constant-folding
    rule (``(consts, params, out_avals) -> consts or None``: a ``convert_element_type`` of a
    Python scalar becomes a literal, no equation) and its forwarding rule (``eqn ->
    (input index or None per output, eqn or None)``: a ``convert_element_type`` to the same
    type is its input). Either is None where the primitive has none."""
    return _pe.const_fold_rules.get(primitive), _pe.forwarding_rules.get(primitive)


def bind(eqn: JaxprEqn, *args: Any) -> list[Any]:
    out = eqn.primitive.bind(*_match_varying(eqn, args), **bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


def _match_varying(eqn: JaxprEqn, args: Sequence[Any]) -> Sequence[Any]:
    """``args`` cast up to the manual axes the most varying of them varies over, where the
    traced equation's inputs all varied alike but the re-bound ones do not.

    Inside ``shard_map`` an optimisation barrier makes all its operands vary over the same
    axes, so a parameter re-created behind one varies where the traced program had it
    invariant; JAX inserts that cast itself for most primitives, not all
    (``random_fold_in``). The values are the same (the cast is a type change). Outside
    ``shard_map`` nothing varies and nothing changes."""
    if len(args) < 2:
        return args
    kinds = [varying_axes(a) for a in args]
    if len(set(kinds)) <= 1 or len({_aval_varying(v.aval) for v in eqn.invars}) > 1:
        return args
    union = frozenset().union(*kinds)
    from jax import lax

    return [a if k == union else lax.pcast(a, tuple(sorted(union - k, key=str)), to="varying")
            for a, k in zip(args, kinds, strict=True)]
