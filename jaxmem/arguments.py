"""How a call's arguments are split for tracing: what is traced, what is static, and the
objects that need another entry point (nnx graph nodes).

Part of the last box (:mod:`jaxmem.optimized`): the cache key and the traced leaves of a
call come from here. Library types are recognised without importing the library: a module
that was never imported cannot have made one of the arguments.
"""

from __future__ import annotations

import sys
from typing import Any

import jax


def is_nnx_node(x: Any) -> bool:
    """Whether ``x`` is a flax nnx graph node (Module, Optimizer, Rngs, ...) or Variable."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    return isinstance(x, nnx.Variable | nnx.Pytree)


def check_no_nnx_nodes(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
    """Raise ``TypeError`` if an argument holds an nnx graph node: ``jaxmem.optimize`` would
    trace its Variables' values and drop what the step writes into them."""
    leaves = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=is_nnx_node)[0]
    for path, leaf in leaves:
        if is_nnx_node(leaf):
            where = _where(path)
            raise TypeError(
                f"jaxmem.optimize({name}): argument {where} is an nnx "
                f"{type(leaf).__name__}. jaxmem.optimize is a jax.jit: it would not write "
                "the step's in-place updates (optimizer.update, BatchNorm statistics, RNG "
                "counters) back into the module. Use jaxmem.flax.nnx.optimize(step), which "
                "has nnx.jit's semantics, instead.")


def _where(path: tuple[Any, ...]) -> str:
    """``args[1]['encoder']`` or ``kwargs['model']`` for a path into ``(args, kwargs)``."""
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0 and rest:
        return f"args[{rest[0].idx}]" + jax.tree_util.keystr(rest[1:])
    return "kwargs" + jax.tree_util.keystr(rest)
