"""Memory-lean equivalents of primitives whose XLA lowering holds large temporaries.

The joint rewrite (:mod:`jaxmem.rewriting.rewrite`) re-binds every equation of a train step; for the
primitives listed here it emits an equivalent computation instead, one that gives the same
values but lets XLA fuse it into a few elementwise loops.

``select_and_scatter_add`` is max-pooling's derivative (the transpose of
``select_and_gather_add``, JAX's JVP of ``reduce_window_max``). XLA:CPU expands it into a
variadic ``reduce_window`` over the operand *and one int32 iota plane of the operand's shape
per dimension*, then a scatter: for a 4-d NHWC pool that is four int32 copies of the pooled
input at once, which on a CNN is the largest buffer of the step. The substitute picks each
window's element with the same ``select`` rule, in the same order, from strided slices of the
operand, and spreads the cotangent back with ``lax.pad`` — nothing larger than the operand and
its gradient is made.

Equality: for non-overlapping windows (stride = window, the usual 2x2/2 pool) every input
element receives at most one cotangent and the result is bit-identical to XLA's, ties and
NaN included (``tests/test_substitutes.py``). Where windows overlap an input element sums the
cotangents of several windows, and the order of that sum may differ from XLA's: equal to
float rounding (a few ulps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmem import _jax

_SELECTS = ("ge", "le", "gt", "lt")


def _identity(select: str, dtype: Any) -> Any:
    """The padding value no real element loses to under ``select``."""
    dtype = np.dtype(dtype)
    big = np.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max
    small = -np.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min
    return small if select in ("ge", "gt") else big


def select_and_scatter_add(source: Any, operand: Any, *, select_prim: Any,
                           window_dimensions: tuple[int, ...], window_strides: tuple[int, ...],
                           padding: tuple[tuple[int, int], ...]) -> Any:
    """``lax``'s ``select_and_scatter_add`` as strided slices, selects and pads.

    For each window (the windows of ``reduce_window`` over ``operand`` with these dimensions,
    strides and padding) the element chosen is the first, in row-major window order, that
    ``select_prim`` keeps against every later one; ``source`` (one value per window) is added
    at that element's position. Padding positions hold the select's identity (``-inf`` for a
    max pool) and receive nothing.
    """
    select = select_prim.bind
    out_shape = tuple(source.shape)
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    x = operand
    if any(lo or hi for lo, hi in pads):
        fill = jnp.asarray(_identity(select_prim.name, operand.dtype), operand.dtype)
        x = lax.pad(operand, fill, [(lo, hi, 0) for lo, hi in pads])
    offsets = list(np.ndindex(*window_dimensions))
    idx_dtype = jnp.int8 if len(offsets) <= 127 else jnp.int32

    def window_slice(off: tuple[int, ...]) -> Any:
        start = off
        limit = tuple(o + s * (n - 1) + 1 for o, s, n in zip(off, window_strides, out_shape,
                                                                strict=True))
        return lax.slice(x, start, limit, window_strides)

    best = window_slice(offsets[0])
    which = jnp.zeros(out_shape, idx_dtype)
    for k, off in enumerate(offsets[1:], start=1):
        cand = window_slice(off)
        take = ~select(best, cand)  # XLA keeps the current choice while select(current, new)
        best = jnp.where(take, cand, best)
        which = jnp.where(take, jnp.asarray(k, idx_dtype), which)

    zero = jnp.zeros((), source.dtype)
    full = x.shape
    total = None
    for k, off in enumerate(offsets):
        part = jnp.where(which == k, source, zero)
        # Place window (i_0, i_1, ...)'s share at o + s*i in the padded operand's frame.
        config = []
        for o, s, n, size in zip(off, window_strides, out_shape, full, strict=True):
            hi = size - (o + s * (n - 1) + 1)
            config.append((o, hi, s - 1))
        placed = lax.pad(part, zero, config)
        total = placed if total is None else total + placed
    if any(lo or hi for lo, hi in pads):
        total = lax.slice(total, [lo for lo, _ in pads],
                          [lo + d for (lo, _), d in zip(pads, operand.shape, strict=True)])
    return total


def _select_and_scatter_add_supported(params: dict[str, Any], avals: list[Any]) -> bool:
    if getattr(params.get("select_prim"), "name", None) not in _SELECTS:
        return False
    source, operand = avals
    if any(s <= 0 for s in source.shape) or any(s <= 0 for s in operand.shape):
        return False
    # Up to 64 window positions: the substitute unrolls one select per position.
    return math.prod(params["window_dimensions"]) <= 64


def pvary(x: Any, *, axes: tuple[Any, ...], **params: Any) -> Any:
    """``pvary`` over the axes ``x`` does not vary over yet; ``x`` itself if none.

    Inside a ``shard_map`` body a value re-created behind an optimisation barrier already
    varies over the barrier's axes (JAX makes all its operands vary alike), and re-binding
    the body's own ``pvary`` on it would fail. The value is the same either
    way (``pvary`` is a type cast).
    """
    have = _jax.varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x


SUBSTITUTES: dict[str, tuple[Callable[..., Any], Callable[[dict[str, Any], list[Any]], bool]]] = {
    "select_and_scatter_add": (select_and_scatter_add, _select_and_scatter_add_supported),
    "pvary": (pvary, lambda params, avals: True),
}
"""Primitive name -> (equivalent function, ``supported(params, in_avals)``)."""


def substitute_for(eqn: Any) -> Callable[..., list[Any]] | None:
    """A function computing ``eqn``'s outputs from its inputs more leanly, or ``None``."""
    entry = SUBSTITUTES.get(eqn.primitive.name)
    if entry is None:
        return None
    fn, supported = entry
    avals = [v.aval for v in eqn.invars]
    if not supported(eqn.params, avals):
        return None

    def run(*args: Any) -> list[Any]:
        return [fn(*args, **eqn.params)]

    return run
