"""What an abstract value's type says beyond shape and dtype (bottom layer,
:mod:`jaxmem._jax`).

Its memory space (device or host), the manual mesh axes it varies over inside
``shard_map``, into how many pieces its sharding in types splits it across devices, and
whether its dtype is a floating one.
"""

from __future__ import annotations

from typing import Any

import jax


def aval_memory_space(aval: Any) -> Any:
    return getattr(aval, "memory_space", None)


def _aval_varying(aval: Any) -> frozenset[Any]:
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes a value varies over inside ``shard_map`` (empty outside)."""
    return _aval_varying(jax.typeof(x))


def shards(aval: Any) -> int:
    """Into how many pieces an array of ``aval`` is split across devices, by the mesh axes
    its type names (sharding in types: ``Explicit`` mesh axes in its spec); 1 where the type
    says nothing (``Auto`` axes, where XLA chooses, or no mesh)."""
    try:
        sharding = getattr(aval, "sharding", None)
    except Exception:  # noqa: BLE001 - avals without a sharding (tokens)
        return 1
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or mesh is None:
        return 1
    explicit = set(getattr(mesh, "explicit_axes", ()) or ())
    n = 1
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None and axis in explicit:
                n *= int(mesh.shape[axis])
    return n


def is_floating(x: Any) -> bool:
    """Whether ``x`` (an array, tracer or aval) has a floating dtype; False for extended
    dtypes (PRNG keys) and for what has no dtype."""
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))
    except TypeError:  # extended dtypes (PRNG keys) in some jax versions
        return False
