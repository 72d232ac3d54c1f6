"""How a call's arguments are split for tracing: what is traced, what is static, and the
objects that need another entry point (nnx graph nodes).

The rule, applied to the arguments and to the step's outputs alike: inside an equinox
``Module``, ``eqx.filter_jit``'s (arrays are traced; every other leaf, Python scalars
included, is static: an ``eqx.nn.MLP``'s activation, ``Dropout``'s ``p`` and ``inference``);
elsewhere ``jax.jit``'s (arrays and Python scalars are traced; any other leaf is an error
that names it, from :func:`jaxmem.program.check_leaves`). A static leaf is part of the
cache key, so it must be hashable, and reaches the step as the Python object itself.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax

from jaxmem.tracing.program import _describe_leaf, _is_traceable_leaf


def is_nnx_node(x: Any) -> bool:
    """Whether ``x`` is a flax nnx graph node (Module, Optimizer, Rngs, ...) or Variable."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    return isinstance(x, nnx.Variable | nnx.Pytree)


def check_no_nnx_nodes(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
    """Raise ``TypeError`` if an argument holds an nnx graph node or a bare Variable:
    ``jaxmem.optimize`` would trace its values and drop what the step writes into them.

    An ``nnx.State`` (from ``nnx.split``: the functional API, where the step returns the
    new state) is an ordinary pytree and passes, Variables inside it included."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    stop = lambda x: isinstance(x, nnx.State | nnx.Variable | nnx.Pytree)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=stop)[0]
    for path, leaf in leaves:
        if is_nnx_node(leaf):
            raise TypeError(
                f"jaxmem.optimize({name}): argument {_where(path)} is an nnx "
                f"{type(leaf).__name__}. jaxmem.optimize is a jax.jit: it would not write "
                "the step's in-place updates (optimizer.update, BatchNorm statistics, RNG "
                "counters) back into the module. Use jaxmem.flax.nnx.optimize(step), which "
                "has nnx.jit's semantics, instead (or pass the nnx.split state and return "
                "the new one).")


def _where(path: tuple[Any, ...]) -> str:
    """``args[1]['encoder']`` or ``kwargs['model']`` for a path into ``(args, kwargs)``."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0 and rest:
        return f"args[{rest[0].idx}]" + jax.tree_util.keystr(rest[1:])
    return "kwargs" + jax.tree_util.keystr(rest)


def _is_eqx_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _is_array(x: Any) -> bool:
    return _is_traceable_leaf(x) and not isinstance(x, bool | int | float | complex)


def _traced_mask(tree: Any) -> list[bool]:
    """Per leaf of ``tree``: traced (True) or static (False), by the module's rule."""
    def mark(sub: Any) -> Any:
        if _is_eqx_module(sub):
            return jax.tree_util.tree_map(_is_array, sub)
        return True  # jax.jit's rule: check_leaves names what cannot be traced
    return jax.tree_util.tree_leaves(jax.tree_util.tree_map(mark, tree, is_leaf=_is_eqx_module))


@dataclasses.dataclass(frozen=True)
class Static:
    """The static leaves of a tree, and the tree's structure to put them back into."""

    treedef: Any
    positions: tuple[int, ...]
    values: tuple[Any, ...]

    def __hash__(self) -> int:
        return hash((self.treedef, self.positions, self.values))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Static):
            return False
        return (self.treedef == other.treedef and self.positions == other.positions
                and all(a is b or a == b for a, b in zip(self.values, other.values,
                                                         strict=True)))


def partition(tree: Any, what: str = "argument") -> tuple[Any, Static | None]:
    """Split ``tree`` into its traced part (``None`` where a static leaf was) and its
    static leaves (``None`` when there are none: the tree is left as it is).

    Example:
      >>> import equinox as eqx, jax
      >>> mlp = eqx.nn.MLP(2, 2, width_size=4, depth=1, key=jax.random.key(0))
      >>> dyn, static = partition((mlp,))
      >>> dyn[0].activation is None, static.values[0] is mlp.activation
      (True, True)
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    mask = _traced_mask(tree)
    if all(mask):
        return tree, None
    positions = tuple(i for i, m in enumerate(mask) if not m)
    for i in positions:
        path, leaf = with_path[i]
        try:
            hash(leaf)
        except TypeError as e:
            raise TypeError(
                f"{what} leaf {jax.tree_util.keystr(path)} is a {_describe_leaf(leaf)} "
                f"({leaf!r:.60}), not an array, and not hashable ({e}). jaxmem treats "
                "non-array leaves as static, as eqx.filter_jit does, and keys its cache on "
                "them; make it hashable, or pass it through functools.partial.") from e
    leaves = [leaf for _, leaf in with_path]
    dyn = jax.tree_util.tree_unflatten(
        treedef, [None if i in set(positions) else x for i, x in enumerate(leaves)])
    return dyn, Static(treedef, positions, tuple(leaves[i] for i in positions))


def combine(dyn: Any, static: Static | None) -> Any:
    """Inverse of :func:`partition`."""
    if static is None:
        return dyn
    full: list[Any] = [None] * static.treedef.num_leaves
    for i, v in zip(static.positions, static.values, strict=True):
        full[i] = v
    static_tree = jax.tree_util.tree_unflatten(static.treedef, full)
    return jax.tree_util.tree_map(lambda d, s: s if d is None else d, dyn, static_tree,
                                  is_leaf=lambda x: x is None)
