"""One call's arguments as ``jax.jit`` sees them: static and traced, and the cache key.

Part of the fifth box (:mod:`jaxmem.compiling`), the first step of every call of
:class:`~jaxmem.optimized.Optimized`. :func:`of` splits a call's arguments into the static
ones (``static_argnums`` / ``static_argnames``, however they are passed) and the traced
ones, the traced ones' static leaves (Python scalars, strings: :mod:`jaxmem.tracing.arguments`)
aside, and keys the result by tree structure, shapes, dtypes, weak types, shardings and
static values, like ``jax.jit``'s cache: one plan and one executable per :class:`Signature`.
:func:`bind` is the user's step with the static parts put back; the last helpers say where
the arguments are placed (the target parts of the plan cache's key).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmem.analyzing.costmodel import DeviceProfile
from jaxmem.memory import state_offload
from jaxmem.tracing import arguments
from jaxmem.tracing.program import check_leaves
from jaxmem.xla import targets


class Signature(NamedTuple):
    """A call's arguments split as ``jax.jit`` splits them, and the key of its cache entry."""

    key: Any  # hashable: the per-signature cache's key
    static: tuple[int, ...]  # positions of the static positional arguments
    static_kw: dict[str, Any]  # static keyword arguments
    dyn_args: tuple[Any, ...]  # the traced positional arguments (device views of host state)
    kwargs: dict[str, Any]  # the traced keyword arguments (likewise)
    leaf_static: Any  # their static leaves (arguments.partition)
    flat: list[Any]  # the traced leaves, as passed: what the executable is called with


def of(fn: Callable[..., Any], static_argnums: int | Sequence[int] | None,
       static_argnames: tuple[str, ...], offload_state: Any, args: tuple[Any, ...],
       kwargs: dict[str, Any]) -> Signature:
    """The signature of ``fn(*args, **kwargs)``; ``TypeError`` for an unhashable static."""
    arguments.check_no_nnx_nodes(args, kwargs, getattr(fn, "__name__", "fn"))
    static, static_vals, static_names = split_static(fn, static_argnums, static_argnames,
                                                     args, kwargs)
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static)
    static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in static_names))
    kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
    (dyn_args, kwargs), leaf_static = arguments.partition((dyn_args, kwargs))
    check_leaves(dyn_args, kwargs)
    flat, in_tree = jax.tree_util.tree_flatten((dyn_args, kwargs))
    if offload_state:  # traced, keyed and compared on the device, streamed from host
        dyn_args, kwargs = jax.tree.map(state_offload.device_view, (dyn_args, kwargs))
    try:
        leaves = jax.tree_util.tree_leaves((dyn_args, kwargs))
        key = (in_tree, tuple(leaf_key(x) for x in leaves), static, static_vals, static_kw,
               leaf_static)
        hash(key)
    except TypeError as e:
        raise TypeError(f"static arguments must be hashable: {e}") from e
    return Signature(key, static, dict(static_kw), dyn_args, kwargs, leaf_static, flat)


def split_static(fn: Callable[..., Any], static_argnums: int | Sequence[int] | None,
                 static_argnames: tuple[str, ...], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[Any, ...],
                                                  frozenset[str]]:
    """Static positions, their values, and static keyword names. As in ``jax.jit``, a
    static argument is static however it is passed: ``static_argnames`` given
    positionally, ``static_argnums`` given by keyword (matched through the signature)."""
    names = positional_names(fn)
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(
        static_argnums or ())
    by_kw = {names[i % len(names)] for i in nums
             if names and not -len(args) <= i < len(args) and -len(names) <= i < len(names)
             and names[i % len(names)] in kwargs}
    nums = tuple(i for i in nums if not (names and -len(names) <= i < len(names)
                                          and names[i % len(names)] in by_kw))
    nums += tuple(names.index(n) for n in static_argnames
                  if n in names and names.index(n) < len(args))
    static = normalise_argnums(nums, len(args))
    return static, tuple(args[i] for i in static), frozenset(static_argnames) | by_kw


def bind(fn: Callable[..., Any], args: tuple[Any, ...], static: tuple[int, ...],
         static_kw: dict[str, Any], leaf_static: Any = None) -> Callable[..., Any]:
    """``fn`` on the traced arguments alone: the static ones (and static leaves) put back.
    After a trace, its ``static_out`` holds the step's static (non-array) outputs."""
    def call(*dyn: Any, **kw: Any) -> Any:
        dyn, kw = arguments.combine((dyn, kw), leaf_static)
        it = iter(dyn)
        full = [args[i] if i in static else next(it) for i in range(len(args))]
        out, call.static_out = arguments.partition(fn(*full, **kw, **static_kw), "output")
        return out
    call.__name__ = getattr(fn, "__name__", "fn")  # named in trace errors
    return call


def positional_names(fn: Callable[..., Any]) -> list[str]:
    """Names of ``fn``'s positional parameters, in order ([] when it has no signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def normalise_argnums(argnums: int | Sequence[int] | None, n: int) -> tuple[int, ...]:
    """``argnums`` as sorted non-negative positions among ``n`` arguments."""
    if argnums is None:
        return ()
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    out = []
    for a in nums:
        if not -n <= a < n:
            raise ValueError(f"argnum {a} is out of range for {n} positional arguments")
        out.append(a % n)
    return tuple(sorted(set(out)))


#: Python scalar types: ``jax.jit`` traces each as a weakly typed array.
SCALARS = (bool, int, float, complex)


def abstract(x: Any) -> tuple[tuple[int, ...], str]:
    """The shape and dtype ``jax.jit`` traces a leaf as (a Python scalar: its canonical
    dtype, ``3`` as ``int32``; a NumPy array: its canonical dtype, float64 as float32
    without x64)."""
    if isinstance(x, SCALARS):
        return (), str(jax.dtypes.result_type(x))
    if isinstance(x, np.ndarray | np.generic):
        return x.shape, str(jax.dtypes.canonicalize_dtype(x.dtype))
    return tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", ""))


def leaf_key(x: Any) -> Any:
    """A traced leaf's part of the cache key: shape, dtype, weak type and sharding, as
    ``jax.jit`` traces it. A Python scalar is keyed as the weakly typed array ``jax.jit``
    makes of it (``3``: ``int32``, weak), and a rank-0 leaf's placement is left out (a
    scalar's sizes and plan do not depend on it; an executable that rejects a placement
    is compiled again for it, :func:`jaxmem.compiling.entry.placed`): a flax
    ``TrainState``'s ``step``, an ``int`` on the first call and the array the step returns
    on the next, is one signature, as for ``jax.jit``."""
    if isinstance(x, SCALARS):
        return (*abstract(x), not isinstance(x, bool), None)
    shape = tuple(getattr(x, "shape", ()))
    sharding = getattr(x, "sharding", None) if shape else None
    return (shape, str(getattr(x, "dtype", type(x))), getattr(x, "weak_type", False),
            None if sharding is None else repr(sharding))


def placement(flat: Sequence[Any]) -> Any:
    """Committed devices and shardings of the arguments: which executable takes them."""
    return tuple((getattr(x, "committed", None), repr(getattr(x, "sharding", None)))
                 for x in flat)


def shardings(flat: Sequence[Any]) -> tuple[str, ...]:
    """The arguments' shardings, for the plan cache: a jaxpr traced on an ``Auto`` mesh
    does not show them, yet per-device sizes (and so plans and figures) follow them."""
    return tuple(repr(getattr(x, "sharding", None)) for x in flat)


def device_of(flat: Sequence[Any]) -> Any:
    """The first device an argument is placed on (None: the default device)."""
    for x in flat:
        s = getattr(x, "sharding", None)
        if s is not None and getattr(s, "device_set", None):
            return next(iter(s.device_set))
    return None


def device_kind(flat: Sequence[Any]) -> str:
    """The kind of the arguments' device (the default device's where they name none)."""
    device = device_of(flat) or jax.devices()[0]
    return str(getattr(device, "device_kind", device.platform))


def profile_of(flat: Sequence[Any]) -> str:
    """The device profile preset of the arguments' target (``"cpu"`` where unknown, or
    where the target has no preset: a TPU's, for now; the printout names the profile)."""
    try:
        profile = targets.of(flat).profile
        DeviceProfile.get(profile)  # a preset the cost model knows (raises otherwise)
    except Exception:  # noqa: BLE001 - a label for a note: never fail the step over it
        return "cpu"
    return profile
